"""Packing a job's code directory into the archive `POST /v1/code` takes: a zip, the same bytes for the same files.

`.gitignore` and `.ringmasterignore` files (gitignore patterns, in the directory they sit in and below it) leave
out what they match; `.git`, `__pycache__` and `.venv` are always left out. Entries are sorted and carry a fixed
time and mode, so packing a directory again gives the same SHA-256 and the server stores it once.
"""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pathspec

from ringmaster.service.errors import CodeTooLarge

IGNORE_FILES = (".gitignore", ".ringmasterignore")
ALWAYS_LEFT_OUT = frozenset({".git", "__pycache__", ".venv"})
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest a zip can say


class CodeDirectoryError(ValueError):
    """The directory cannot be packed: missing, not a directory, or nothing left in it to ship."""


@dataclass(frozen=True)
class PackedCode:
    content: bytes
    files: int
    unpacked_bytes: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def ref(self) -> str:
        """What a JobSpec's `code` names it by."""
        return f"sha256:{self.sha256}"


def files_to_pack(root: Path) -> list[tuple[str, Path]]:
    """(path inside the archive, file) for every file the ignore rules keep, sorted by the archive path."""
    if not root.is_dir():
        raise CodeDirectoryError(f"{root} is not a directory")
    root = root.resolve()
    rules: dict[str, pathspec.GitIgnoreSpec] = {}  # directory (relative, '' for the root) -> its ignore files' patterns
    kept: list[tuple[str, Path]] = []
    for directory, subdirectories, names in os.walk(root):
        relative = Path(directory).relative_to(root).as_posix()
        relative = "" if relative == "." else relative
        lines = [
            line
            for name in IGNORE_FILES
            if (Path(directory) / name).is_file()
            for line in (Path(directory) / name).read_text(errors="replace").splitlines()
        ]
        if lines:
            rules[relative] = pathspec.GitIgnoreSpec.from_lines(lines)
        subdirectories[:] = sorted(
            name
            for name in subdirectories
            if name not in ALWAYS_LEFT_OUT and not _ignored(rules, _join(relative, name), directory=True)
        )
        for name in sorted(names):
            path = _join(relative, name)
            file = Path(directory) / name
            if file.is_file() and not _ignored(rules, path, directory=False):
                kept.append((path, file))
    return sorted(kept)


def _join(directory: str, name: str) -> str:
    return f"{directory}/{name}" if directory else name


def _ignored(rules: dict[str, pathspec.GitIgnoreSpec], path: str, directory: bool) -> bool:
    """Whether an ignore file in one of the path's parent directories matches it (relative to that directory)."""
    for base, spec in rules.items():
        if base == "" or path.startswith(base + "/"):
            inner = path[len(base) + 1 :] if base else path
            if spec.match_file(inner + "/" if directory else inner):
                return True
    return False


def pack_directory(root: Path, max_bytes: int) -> PackedCode:
    """The directory's kept files as a deterministic zip; CodeTooLarge past max_bytes (packed or unpacked)."""
    entries = files_to_pack(root)
    if not entries:
        raise CodeDirectoryError(f"{root} holds no files to pack (after .gitignore and .ringmasterignore)")
    unpacked = 0
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as archive:
        for name, file in entries:
            data = file.read_bytes()
            unpacked += len(data)
            if unpacked > max_bytes:
                raise CodeTooLarge(
                    f"the code in {root} (unpacked)",
                    sum(path.stat().st_size for _, path in entries),
                    max_bytes,
                    hint="; leave out what the job need not ship with a .ringmasterignore",
                )
            info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.create_system = 3  # unix, whatever packs it: the mode bits below mean the same everywhere
            info.external_attr = (0o100755 if os.access(file, os.X_OK) else 0o100644) << 16
            archive.writestr(info, data)
    content = buffer.getvalue()
    if len(content) > max_bytes:
        raise CodeTooLarge(f"the code archive of {root}", len(content), max_bytes)
    return PackedCode(content=content, files=len(entries), unpacked_bytes=unpacked)
