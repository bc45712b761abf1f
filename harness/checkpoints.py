"""Reading and writing checkpoints the way tests check them: synchronous saves, the newest usable checkpoint, its
model weights alone. The product's own paths (workers/checkpoint/) are asynchronous and go through the trainer."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.optim import Optimizer

from ringmaster.service.spec import JobSpec
from ringmaster.workers.checkpoint.durable import (
    CommittedCheckpoint,
    begin_save,
    commit_save,
    committed_checkpoints,
    find_resume_point,
    verify_checkpoint,
)
from ringmaster.workers.checkpoint.storage import storage_for
from ringmaster.workers.data.stream import DataPosition


def usable_checkpoints(storage_root: str | Path) -> list[CommittedCheckpoint]:
    """Committed checkpoints whose files match their manifests, newest first."""
    return [
        checkpoint
        for checkpoint in reversed(committed_checkpoints(storage_root))
        if verify_checkpoint(checkpoint) is None
    ]


def latest_committed(storage_root: str | Path) -> CommittedCheckpoint | None:
    """The newest checkpoint a run may resume from (committed and verified), or None."""
    return find_resume_point(storage_root)[0]


def save_checkpoint(
    storage_root: str | Path,
    spec: JobSpec,
    *,
    step: int,
    position: DataPosition,
    model_parts: list[nn.Module],
    optimizers: list[Optimizer],
    metric_value: float | None = None,
) -> str:
    """Collective and synchronous: every rank writes its shards, then rank 0 commits and applies retention.
    ``optimizers[i]`` steps ``model_parts[i]`` (several parts only under interleaved pipelining)."""
    pending = begin_save(
        storage_root,
        spec,
        step=step,
        position=position,
        model_parts=model_parts,
        optimizers=optimizers,
        metric_value=metric_value,
    )
    if dist.get_rank() == 0:
        commit_save(pending)
    return pending.path


def load_model_weights(path: str | Path, model: nn.Module) -> None:
    """Load only the model's weights into a plain (unwrapped) module, e.g. to evaluate it; collective
    when a process group exists, a local read otherwise."""
    storage, location = storage_for(path)
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=storage.reader(location))
    model.load_state_dict(state["model"])
