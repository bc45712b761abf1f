"""Sharded, atomically committed checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is ``{storage_root}/step-{step:08d}/``: DCP shards plus ``manifest.json``, which rank 0
writes last, after every rank's shards are on disk. A directory without a valid manifest is an
interrupted save and is never resumed from. The manifest lists every file of the checkpoint with its
size (and the sha256 of DCP's small ``.metadata``); a checkpoint whose files no longer match is
corrupt and skipped in favour of the next older one that verifies.

Saves may be asynchronous (``begin_save(..., process_group=...)``): DCP stages a copy of the state
in memory and writes it from a background thread over a dedicated gloo group, while training goes
on; ``commit_save`` (rank 0, once the save's future is done) writes the manifest and applies retention.

Every key is the unsplit model's FQN (optimizer state flattened per parameter), whatever the strategy:
each rank saves only what it holds (FSDP/TP shards, its pipeline stages, ZeRO-1's owned state), so a
checkpoint can be loaded at another world size or by another strategy. The learning rate is a function
of the step, so no scheduler state is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from concurrent.futures import Future
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
DCP_METADATA_NAME = ".metadata"
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


def verify_checkpoint(checkpoint: CommittedCheckpoint) -> str | None:
    """None when the checkpoint's files match its manifest, else what is wrong (the first mismatch).
    A manifest without a file list (written before lists existed) is trusted."""
    files = checkpoint.manifest.get("files")
    if files is None:
        return None
    where = checkpoint.path.name
    for name, size in sorted(files.items()):
        try:
            actual = (checkpoint.path / name).stat().st_size
        except OSError:
            return f"{where}/{name} is missing"
        if actual != size:
            return f"{where}/{name}: {actual} bytes, manifest says {size}"
    expected_sha = checkpoint.manifest.get("metadata_sha256")
    if expected_sha is not None and _sha256(checkpoint.path / DCP_METADATA_NAME) != expected_sha:
        return f"{where}/{DCP_METADATA_NAME}: sha256 differs from the manifest's"
    return None


def find_resume_point(storage_root: str | Path) -> tuple[CommittedCheckpoint | None, list[tuple[CommittedCheckpoint, str]]]:
    """The newest committed checkpoint that verifies (or None), and the newer committed ones skipped
    as corrupt, each with what is wrong, newest first."""
    skipped: list[tuple[CommittedCheckpoint, str]] = []
    for checkpoint in reversed(committed_checkpoints(storage_root)):
        problem = verify_checkpoint(checkpoint)
        if problem is None:
            return checkpoint, skipped
        skipped.append((checkpoint, problem))
    return None, skipped


def usable_checkpoints(storage_root: str | Path) -> list[CommittedCheckpoint]:
    """Committed checkpoints whose files match their manifests, newest first."""
    return [checkpoint for checkpoint in reversed(committed_checkpoints(storage_root)) if verify_checkpoint(checkpoint) is None]


def latest_committed(storage_root: str | Path) -> CommittedCheckpoint | None:
    """The newest checkpoint a run may resume from (committed and verified), or None."""
    return find_resume_point(storage_root)[0]


def _storage_writer(path: Path) -> dcp.FileSystemWriter:
    """Where DCP writes a checkpoint's shards (a seam for tests that slow writes down)."""
    return dcp.FileSystemWriter(path)


@dataclass
class PendingSave:
    """A save whose shards are being (or have been) written; committed by ``commit_save``."""

    storage_root: Path
    step: int
    path: Path
    manifest: dict[str, Any]
    keep: int
    future: Future | None = None  # None: written synchronously

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()  # re-raises a failed write


def begin_save(
    storage_root: str | Path,
    spec: JobSpec,
    *,
    step: int,
    position: DataPosition,
    model_parts: list[nn.Module],
    optimizers: list[Optimizer],
    process_group: dist.ProcessGroup | None = None,
) -> PendingSave:
    """Collective: start writing this rank's shards. With ``process_group`` (a gloo group used for
    nothing else) the write is asynchronous: the state is staged into a copy and written by a
    background thread; otherwise it is written before returning. Nothing is committed yet."""
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
    manifest = {"step": step, "world_size": world_size, "strategy": spec.strategy, "spec_hash": spec.spec_hash()}
    pending = PendingSave(Path(storage_root), step, path, manifest, spec.checkpoint.keep)
    if process_group is None:
        dcp.save(state, storage_writer=_storage_writer(path))
        dist.barrier()
    else:
        pending.future = dcp.async_save(state, storage_writer=_storage_writer(path), process_group=process_group)
    return pending


def commit_save(pending: PendingSave) -> Path:
    """Rank 0, once ``pending`` is done (its future done on rank 0 means every rank's shards and DCP's
    metadata are written): write the manifest last, then apply retention."""
    pending.wait()
    files = {
        entry.name: entry.stat().st_size
        for entry in sorted(pending.path.iterdir())
        if entry.is_file() and entry.name != MANIFEST_NAME and not entry.name.endswith(".partial")
    }
    manifest = dict(pending.manifest, time=time.time(), files=files, metadata_sha256=_sha256(pending.path / DCP_METADATA_NAME))
    _write_atomically(pending.path / MANIFEST_NAME, json.dumps(manifest, indent=2))
    apply_retention(pending.storage_root, pending.keep)
    return pending.path


def save_checkpoint(
    storage_root: str | Path,
    spec: JobSpec,
    *,
    step: int,
    position: DataPosition,
    model_parts: list[nn.Module],
    optimizers: list[Optimizer],
) -> Path:
    """Collective and synchronous: every rank writes its shards, then rank 0 commits and applies retention.
    ``optimizers[i]`` steps ``model_parts[i]`` (several parts only under interleaved pipelining)."""
    pending = begin_save(storage_root, spec, step=step, position=position, model_parts=model_parts, optimizers=optimizers)
    if dist.get_rank() == 0:
        commit_save(pending)
    return pending.path


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


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


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
