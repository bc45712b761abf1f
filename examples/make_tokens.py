"""Write a flat token file (the nanoGPT/torchtitan format) from local text, for examples/hf-tokens.yaml.

    python examples/make_tokens.py [TEXT_FILE_OR_DIR ...] [--out /tmp/ringmaster-examples/text.bin]

Tokens are the text's UTF-8 bytes (ids 0-255) as uint16, so any model with vocab_size >= 256 trains on them. With no
inputs it reads this repository's README and examples; pass your own files or directories (every *.txt, *.md and *.py
below a directory, in sorted order).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = Path("/tmp/ringmaster-examples/text.bin")


def text_files(inputs: list[Path]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        if item.is_dir():
            files += sorted(path for pattern in ("*.txt", "*.md", "*.py") for path in item.rglob(pattern))
        elif item.is_file():
            files.append(item)
        else:
            raise SystemExit(f"no such file or directory: {item}")
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*", type=Path, default=[HERE.parent / "README.md", HERE])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    data = b"\n".join(path.read_bytes() for path in text_files(args.inputs))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.frombuffer(data, dtype=np.uint8).astype(np.uint16).tofile(args.out)
    print(f"{args.out}: {len(data)} tokens (uint16) from {len(text_files(args.inputs))} file(s)")


if __name__ == "__main__":
    main()
