"""Sharded, atomically committed checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is ``{storage_root}/step-{step:08d}/``: DCP shards plus ``manifest.json``, which rank 0
writes last, after every rank's shards are on disk. A directory without a valid manifest is an
interrupted save and is never resumed from.

Every key is the unsplit model's FQN (optimizer state flattened per parameter), whatever the strategy:
each rank saves only what it holds (FSDP/TP shards, its pipeline stages, ZeRO-1's owned state), so a
checkpoint can be loaded at another world size or by another strategy. The learning rate is a function
of the step, so no scheduler state is kept.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim import Optimizer

from service.spec import JobSpec
from workers.data.stream import DataPosition
from workers.strategies.zero1 import local_optimizer

MANIFEST_NAME = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# A rank's parts each load their own keys out of the merged state of all its parts.
_LOAD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)


@dataclass(frozen=True)
class CommittedCheckpoint:
    step: int
    path: Path
    manifest: dict[str, Any]


@dataclass(frozen=True)
class TrainingProgress:
    """What a resumed run continues from besides tensors: the step and the data stream's position."""

    step: int
    position: DataPosition


def checkpoint_dir(storage_root: str | Path, step: int) -> Path:
    return Path(storage_root) / f"step-{step:08d}"


def committed_checkpoints(storage_root: str | Path) -> list[CommittedCheckpoint]:
    """Checkpoints with a valid manifest, oldest first."""
    root = Path(storage_root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match is None:
            continue
        step = int(match.group(1))
        manifest = _read_manifest(entry / MANIFEST_NAME)
        if manifest is not None and manifest.get("step") == step:
            found.append(CommittedCheckpoint(step, entry, manifest))
    return sorted(found, key=lambda checkpoint: checkpoint.step)


def latest_committed(storage_root: str | Path) -> CommittedCheckpoint | None:
    """The newest checkpoint a run may resume from, or None."""
    committed = committed_checkpoints(storage_root)
    return committed[-1] if committed else None


def save_checkpoint(
    storage_root: str | Path,
    spec: JobSpec,
    *,
    step: int,
    position: DataPosition,
    model_parts: list[nn.Module],
    optimizers: list[Optimizer],
) -> Path:
    """Collective: every rank writes its shards, then rank 0 commits and applies retention.
    ``optimizers[i]`` steps ``model_parts[i]`` (several parts only under interleaved pipelining)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    path = checkpoint_dir(storage_root, step)
    if rank == 0:
        # Leftovers of an interrupted save of this same step must not mix with the new shards.
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()
    model_state, optimizer_state = _merged_state(model_parts, optimizers)
    state = {
        "model": model_state,
        "optimizer": optimizer_state,
        "progress": {"step": step, "epoch": position.epoch, "samples_in_epoch": position.samples_in_epoch},
        "rng": {f"rank{rank}": _rng_state()},
    }
    dcp.save(state, checkpoint_id=path)
    dist.barrier()
    if rank == 0:
        manifest = {"step": step, "world_size": world_size, "strategy": spec.strategy, "spec_hash": spec.spec_hash(), "time": time.time()}
        _write_atomically(path / MANIFEST_NAME, json.dumps(manifest, indent=2))
        apply_retention(storage_root, spec.checkpoint.keep)
    return path


def load_checkpoint(path: str | Path, *, model_parts: list[nn.Module], optimizers: list[Optimizer]) -> TrainingProgress:
    """Collective: restore this rank's model parts, their optimizers and its RNG states from ``path``."""
    rank = dist.get_rank()
    saved_keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model_state, optimizer_state = _merged_state(model_parts, optimizers)
    # A rank that did not exist when the checkpoint was written keeps its freshly seeded RNG.
    rng_state = {name: value for name, value in _rng_state().items() if f"rng.rank{rank}.{name}" in saved_keys}
    state = {
        "model": model_state,
        "optimizer": optimizer_state,
        "progress": {"step": 0, "epoch": 0, "samples_in_epoch": 0},
        "rng": {f"rank{rank}": rng_state},
    }
    dcp.load(state, checkpoint_id=path)
    for part, optimizer in zip(model_parts, optimizers, strict=True):
        set_state_dict(part, local_optimizer(optimizer), model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=_LOAD_OPTIONS)
    _restore_rng_state(state["rng"][f"rank{rank}"])
    progress = state["progress"]
    return TrainingProgress(progress["step"], DataPosition(progress["epoch"], progress["samples_in_epoch"]))


def _merged_state(model_parts: list[nn.Module], optimizers: list[Optimizer]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and flattened optimizer state of all this rank's parts, keyed by the unsplit model's FQNs."""
    model_state: dict[str, Any] = {}
    optimizer_state: dict[str, Any] = {}
    for part, optimizer in zip(model_parts, optimizers, strict=True):
        part_model, part_optimizer = get_state_dict(part, local_optimizer(optimizer), options=_OPTIONS)
        model_state.update(part_model)
        optimizer_state.update(part_optimizer)
    return model_state, optimizer_state


def load_model_weights(path: str | Path, model: nn.Module) -> None:
    """Load only the model's weights into a plain (unwrapped) module, e.g. to evaluate it; collective
    when a process group exists, a local read otherwise."""
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])


def apply_retention(storage_root: str | Path, keep: int) -> None:
    """Keep the newest ``keep`` committed checkpoints; drop older ones and interrupted saves older than the newest."""
    committed = committed_checkpoints(storage_root)
    if not committed:
        return
    for checkpoint in committed[:-keep]:
        shutil.rmtree(checkpoint.path)
    committed_paths = {checkpoint.path for checkpoint in committed}
    newest = committed[-1].step
    for entry in Path(storage_root).iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and int(match.group(1)) < newest and entry not in committed_paths:
            shutil.rmtree(entry)


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng_state(state: dict[str, Any]) -> None:
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
