"""A committed checkpoint's model weights as a safetensors file that any PyTorch or transformers code loads, with no
ringmaster, no process group and no optimizer state: what `ringmaster export` writes.

    python -m ringmaster.workers.checkpoint.export CHECKPOINT OUT_DIR [--hf-class GPT2LMHeadModel --model-options JSON]

CHECKPOINT is a step folder (a local path or an fsspec URI, as `GET /v1/jobs/{id}/checkpoints` lists it); its files
are checked against its manifest first. OUT_DIR gets `model.safetensors`, keyed by the unsplit model's parameter
names whatever strategy and world size wrote the checkpoint (DCP reassembles every shard), and for a `hf:` model also
the config's `config.json`, so `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads it; `model_options.pretrained:
OUT_DIR` starts another job from it. Expected failures print one line on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ringmaster.workers.checkpoint.durable import MANIFEST_NAME, checkpoint_at, verify_checkpoint
from ringmaster.workers.checkpoint.storage import storage_for
from ringmaster.workers.models.hf import DATA_OPTIONS, PRETRAINED_OPTION, model_class_and_config
from ringmaster.workers.models.registry import EntrypointError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
_MODEL_PREFIX = "model."  # DCP flattens the saved state's "model" dict into "model.<parameter name>"


class ExportError(Exception):
    """What makes a checkpoint unexportable, in one line for the person who asked."""


@dataclass(frozen=True)
class Exported:
    weights: Path
    config: Path | None
    tensors: int
    parameter_bytes: int


def export_checkpoint(
    checkpoint: str, out_dir: Path, hf_class: str | None = None, model_options: dict[str, Any] | None = None
) -> Exported:
    """Write `checkpoint`'s model weights (and, with `hf_class`, its transformers config) into `out_dir`, which must
    not exist or be empty; nothing is left there when it fails."""
    from safetensors.torch import save_file

    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} already exists and is not an empty directory: give a new one")
    config = _hf_config(hf_class, model_options or {}) if hf_class else None
    weights = _model_weights(checkpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = out_dir / WEIGHTS_NAME
    partial = out_dir / f".{WEIGHTS_NAME}.partial"
    try:
        save_file(weights, str(partial), metadata={"format": "pt"})  # transformers reads only files marked "pt"
        partial.chmod(0o666 & ~_umask())  # safetensors creates it readable by its owner alone
        partial.replace(written)
        if config is not None:
            config.save_pretrained(str(out_dir))
    except BaseException:
        for path in (partial, written, out_dir / CONFIG_NAME):
            path.unlink(missing_ok=True)
        raise
    return Exported(
        written,
        out_dir / CONFIG_NAME if config is not None else None,
        len(weights),
        sum(tensor.numel() * tensor.element_size() for tensor in weights.values()),
    )


def _model_weights(checkpoint: str) -> dict[str, torch.Tensor]:
    """Every model tensor of a committed checkpoint, whole, on the CPU."""
    committed = checkpoint_at(checkpoint)
    if committed is None:
        raise ExportError(f"{checkpoint} is not a committed checkpoint: it has no readable {MANIFEST_NAME}")
    problem = verify_checkpoint(committed)
    if problem is not None:
        raise ExportError(f"{checkpoint} does not match its manifest: {problem}")
    storage, location = storage_for(committed.path)
    reader = storage.reader(location)
    saved = reader.read_metadata().state_dict_metadata
    template = {
        key.removeprefix(_MODEL_PREFIX): torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in saved.items()
        if key.startswith(_MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
    }
    if not template:
        raise ExportError(f"{checkpoint} holds no model tensors")
    state = {"model": template}
    with warnings.catch_warnings():  # DCP warns that it loads in one process, as meant here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {name: tensor.contiguous() for name, tensor in state["model"].items()}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _hf_config(hf_class: str, model_options: dict[str, Any]) -> PreTrainedConfig:
    """The transformers config an `hf:` job built its model from, naming the class so Auto* classes find it."""
    fields = {name: value for name, value in model_options.items() if name not in (PRETRAINED_OPTION, *DATA_OPTIONS)}
    try:
        _, config = model_class_and_config(hf_class, fields)
    except EntrypointError as error:
        raise ExportError(str(error)) from None
    config.architectures = [hf_class]
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="A committed checkpoint's step folder: a path or fsspec URI.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--hf-class", help="The transformers class of an hf: model, for its config.json.")
    parser.add_argument("--model-options", default="{}", help="The job's model_options, as JSON.")
    args = parser.parse_args(argv)
    try:
        exported = export_checkpoint(args.checkpoint, args.out_dir, args.hf_class, json.loads(args.model_options))
    except (ExportError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "weights": str(exported.weights),
                "config": str(exported.config) if exported.config else None,
                "tensors": exported.tensors,
                "parameter_bytes": exported.parameter_bytes,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
