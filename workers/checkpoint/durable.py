"""Sharded, atomically committed checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is ``{storage_root}/step-{step:08d}/``: DCP shards, ``metrics.json`` (rank 0's metric points the
control plane had not confirmed storing, replayed by an attempt that resumes from it) and ``manifest.json``,
which rank 0 writes last, after every rank's shards are written. The storage root is a local directory or any
fsspec URI (storage.py). A directory without a valid manifest is an interrupted
save and is never resumed from. The manifest lists every file of the checkpoint with its size (and
the sha256 of DCP's small ``.metadata``); a checkpoint whose files no longer match is corrupt and
skipped in favour of the next older one that verifies.

Saves may be asynchronous (``begin_save(..., process_group=...)``): DCP stages a copy of the state
in memory and writes it from a background thread over a dedicated gloo group, while training goes
on; ``commit_save`` (rank 0, once the save's future is done) writes the manifest and applies
retention: the newest ``checkpoint.keep``, plus the best by ``checkpoint.keep_best``'s metric, whose
value each manifest records.

Each rank saves only what it holds (FSDP/TP shards, its pipeline stages, ZeRO-1's owned state), keyed as
training_state.py says, so a checkpoint can be loaded at another world size or by another strategy.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.optim import Optimizer

from ringmaster.service.spec import JobSpec, KeepBestSpec
from ringmaster.workers.checkpoint.storage import CheckpointStorage, storage_for
from ringmaster.workers.checkpoint.training_state import TrainingProgress, load_training_state, training_state
from ringmaster.workers.data.stream import DataPosition

MANIFEST_NAME = "manifest.json"
METRICS_NAME = "metrics.json"
DCP_METADATA_NAME = ".metadata"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True)
class CommittedCheckpoint:
    step: int
    path: str  # a local path or a URI, as the storage root was given
    manifest: dict[str, Any]


@dataclass(frozen=True)
class Retention:
    """What retention did: the committed checkpoints it deleted, the one it keeps as the best by
    ``checkpoint.keep_best``'s metric (None without keep_best or without a recorded value), and every committed one it
    kept, oldest first."""

    deleted: list[str] = field(default_factory=list)
    best: str | None = None
    kept: list[CommittedCheckpoint] = field(default_factory=list)


@dataclass(frozen=True)
class CommittedSave:
    """A save made visible: where it is, and what retention did right after."""

    path: str
    retention: Retention


def checkpoint_dir(storage_root: str | Path, step: int) -> str:
    storage, root = storage_for(storage_root)
    return storage.join(root, f"step-{step:08d}")


def committed_checkpoints(storage_root: str | Path) -> list[CommittedCheckpoint]:
    """Checkpoints with a valid manifest, oldest first."""
    storage, root = storage_for(storage_root)
    found = []
    for name in storage.entries(root):
        match = _STEP_DIR.match(name)
        if match is None:
            continue
        step = int(match.group(1))
        location = storage.join(root, name)
        manifest = _read_manifest(storage, storage.join(location, MANIFEST_NAME))
        if manifest is not None and manifest.get("step") == step:
            found.append(CommittedCheckpoint(step, location, manifest))
    return sorted(found, key=lambda checkpoint: checkpoint.step)


def checkpoint_at(path: str | Path) -> CommittedCheckpoint | None:
    """The committed checkpoint in one step folder (a path or URI), or None where it has no valid manifest."""
    storage, location = storage_for(path)
    manifest = _read_manifest(storage, storage.join(location, MANIFEST_NAME))
    if manifest is None or not isinstance(manifest.get("step"), int):
        return None
    return CommittedCheckpoint(manifest["step"], location, manifest)


def verify_checkpoint(checkpoint: CommittedCheckpoint) -> str | None:
    """None when the checkpoint's files match its manifest, else what is wrong (the first mismatch).
    A manifest without a file list (written before lists existed) is trusted."""
    files = checkpoint.manifest.get("files")
    if files is None:
        return None
    storage, location = storage_for(checkpoint.path)
    where = f"step-{checkpoint.step:08d}"
    try:
        present = storage.files(location)
    except OSError:
        present = {}
    for name, size in sorted(files.items()):
        if name not in present:
            return f"{where}/{name} is missing"
        if present[name] != size:
            return f"{where}/{name}: {present[name]} bytes, manifest says {size}"
    expected_sha = checkpoint.manifest.get("metadata_sha256")
    if (
        expected_sha is not None
        and _sha256(storage.read_bytes(storage.join(location, DCP_METADATA_NAME))) != expected_sha
    ):
        return f"{where}/{DCP_METADATA_NAME}: sha256 differs from the manifest's"
    return None


def checkpoint_metrics(checkpoint: CommittedCheckpoint) -> list[dict[str, Any]]:
    """The metric points rank 0 had recorded and the control plane had not confirmed storing when this checkpoint
    was saved ([] for a checkpoint without them)."""
    if METRICS_NAME not in checkpoint.manifest.get("files", {}):
        return []
    storage, location = storage_for(checkpoint.path)
    points: list[dict[str, Any]] = json.loads(storage.read_bytes(storage.join(location, METRICS_NAME)) or b"[]")
    return points


def find_resume_point(
    storage_root: str | Path,
) -> tuple[CommittedCheckpoint | None, list[tuple[CommittedCheckpoint, str]]]:
    """The newest committed checkpoint that verifies (or None), and the newer committed ones skipped
    as corrupt, each with what is wrong, newest first."""
    skipped: list[tuple[CommittedCheckpoint, str]] = []
    for checkpoint in reversed(committed_checkpoints(storage_root)):
        problem = verify_checkpoint(checkpoint)
        if problem is None:
            return checkpoint, skipped
        skipped.append((checkpoint, problem))
    return None, skipped


def _storage_writer(location: str) -> StorageWriter:
    """Where DCP writes a checkpoint's shards (a seam for tests that slow writes down)."""
    return storage_for(location)[0].writer(location)


@dataclass
class PendingSave:
    """A save whose shards are being (or have been) written; committed by ``commit_save``."""

    storage_root: str
    step: int
    path: str
    manifest: dict[str, Any]
    keep: int
    keep_best: KeepBestSpec | None = None
    future: Future[None] | None = None  # None: written synchronously
    staged: Future[None] | None = None  # done once the state is copied: only then may training change it
    metrics: list[dict[str, Any]] = field(default_factory=list)  # rank 0's points not yet stored by the control plane

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def wait_staged(self) -> None:
        """Before the next change to the model or optimizer state (the optimizer step)."""
        if self.staged is not None:
            self.staged.result()

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
    metric_value: float | None = None,
    stager: AsyncStager | None = None,
    metrics: list[dict[str, Any]] | None = None,
) -> PendingSave:
    """Collective: start writing this rank's shards. With ``process_group`` (a gloo group used for
    nothing else) the write is asynchronous: the state is staged into a copy and written by a
    background thread; otherwise it is written before returning. Nothing is committed yet.
    ``metric_value``: this checkpoint's value of ``checkpoint.keep_best``'s metric. ``stager``: reuse its staging
    buffers (from ``checkpoint_stager``; the previous save that used them must have finished); it may stage in the
    background, so call ``wait_staged`` on the result before changing the state. ``metrics`` (rank 0): the metric
    points the control plane has not confirmed storing, kept with the checkpoint (``checkpoint_metrics``)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    storage, root = storage_for(storage_root)
    path = storage.join(root, f"step-{step:08d}")
    if rank == 0:
        # Leftovers of an interrupted save of this same step must not mix with the new shards.
        storage.remove_tree(path)
        storage.make_dirs(path)
    dist.barrier()
    state = training_state(step, position, model_parts, optimizers)
    manifest: dict[str, Any] = {
        "step": step,
        "world_size": world_size,
        "strategy": spec.strategy,
        "spec_hash": spec.spec_hash(),
    }
    keep_best = spec.checkpoint.keep_best
    if keep_best is not None:
        manifest.update(metric=keep_best.metric, metric_value=metric_value)
    pending = PendingSave(root, step, path, manifest, spec.checkpoint.keep, keep_best, metrics=list(metrics or []))
    if process_group is None:
        dcp.save(state, storage_writer=_storage_writer(path))
        dist.barrier()
    else:
        started = dcp.async_save(
            state, storage_writer=_storage_writer(path), process_group=process_group, async_stager=stager
        )
        if isinstance(started, AsyncSaveResponse):  # staging in the background
            pending.future, pending.staged = started.upload_completion, started.staging_completion
        else:
            pending.future = started
    return pending


def commit_save(pending: PendingSave) -> CommittedSave:
    """Rank 0, once ``pending`` is done (its future done on rank 0 means every rank's shards and DCP's
    metadata are written): write the manifest last, then apply retention."""
    pending.wait()
    storage, _ = storage_for(pending.path)
    if pending.metrics:
        storage.write_text_atomically(storage.join(pending.path, METRICS_NAME), json.dumps(pending.metrics))
    files = {
        name: size
        for name, size in sorted(storage.files(pending.path).items())
        if name != MANIFEST_NAME and not name.endswith(".partial")
    }
    metadata_sha256 = _sha256(storage.read_bytes(storage.join(pending.path, DCP_METADATA_NAME)))
    manifest = dict(pending.manifest, time=time.time(), files=files, metadata_sha256=metadata_sha256)
    storage.write_text_atomically(storage.join(pending.path, MANIFEST_NAME), json.dumps(manifest, indent=2))
    return CommittedSave(pending.path, apply_retention(pending.storage_root, pending.keep, pending.keep_best))


def load_checkpoint(path: str | Path, *, model_parts: list[nn.Module], optimizers: list[Optimizer]) -> TrainingProgress:
    """Collective: restore this rank's model parts, their optimizers and its RNG states from ``path``."""
    storage, location = storage_for(path)
    progress, _ = load_training_state(storage.reader(location), model_parts=model_parts, optimizers=optimizers)
    return progress


def best_checkpoint(
    checkpoints: list[CommittedCheckpoint], keep_best: KeepBestSpec | None
) -> CommittedCheckpoint | None:
    """The checkpoint whose manifest records the best finite value of ``keep_best``'s metric (the
    newest among equals); None without keep_best or without any such value."""
    if keep_best is None:
        return None
    scored = [
        checkpoint
        for checkpoint in checkpoints
        if checkpoint.manifest.get("metric") == keep_best.metric and _finite(checkpoint.manifest.get("metric_value"))
    ]
    if not scored:
        return None
    sign = 1.0 if keep_best.mode == "min" else -1.0
    return min(
        sorted(scored, key=lambda checkpoint: -checkpoint.step),
        key=lambda checkpoint: sign * checkpoint.manifest["metric_value"],
    )


def apply_retention(storage_root: str | Path, keep: int, keep_best: KeepBestSpec | None = None) -> Retention:
    """Keep the newest ``keep`` committed checkpoints and the best by ``keep_best``; delete the other
    committed ones and interrupted saves older than the newest (a newer one may be a save in progress)."""
    storage, root = storage_for(storage_root)
    committed = committed_checkpoints(root)
    if not committed:
        return Retention()
    best = best_checkpoint(committed, keep_best)
    kept = {checkpoint.path for checkpoint in committed[-keep:]} | ({best.path} if best is not None else set())
    deleted = [checkpoint.path for checkpoint in committed if checkpoint.path not in kept]
    for location in deleted:
        storage.remove_tree(location)
    committed_paths = {checkpoint.path for checkpoint in committed}
    newest = committed[-1].step
    for name in storage.entries(root):
        match = _STEP_DIR.match(name)
        location = storage.join(root, name)
        if match and int(match.group(1)) < newest and location not in committed_paths:
            storage.remove_tree(location)
    return Retention(
        deleted,
        best.path if best is not None else None,
        [checkpoint for checkpoint in committed if checkpoint.path in kept],
    )


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_manifest(storage: CheckpointStorage, location: str) -> dict[str, Any] | None:
    content = storage.read_bytes(location)
    if content is None:
        return None
    try:
        manifest = json.loads(content)
    except ValueError:
        return None
    return manifest if isinstance(manifest, dict) else None


def _sha256(content: bytes | None) -> str | None:
    return None if content is None else hashlib.sha256(content).hexdigest()
