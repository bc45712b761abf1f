"""What a checkpoint, durable or in memory, holds of a rank, and how it is staged and loaded back.

A rank's state is its model and optimizer shards, keyed by the unsplit model's FQNs (optimizer state flattened per
parameter) whatever the strategy, so DCP can load it at another world size or into another strategy; besides them the
step, the data position, the rank's RNG states and (rank 0) the metric points a resumed run replays. The learning rate
is a function of the step, so no scheduler state is kept.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim import Optimizer

from ringmaster.workers.data.stream import DataPosition
from ringmaster.workers.strategies.zero1 import local_optimizer

_STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# A rank's parts each load their own keys out of the merged state of all its parts.
_LOAD_PART_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)


@dataclass(frozen=True)
class TrainingProgress:
    """What a resumed run continues from besides tensors: the step and the data stream's position."""

    step: int
    position: DataPosition


def training_state(
    step: int,
    position: DataPosition,
    model_parts: list[nn.Module],
    optimizers: list[Optimizer],
    metrics: str | None = None,
) -> dict[str, Any]:
    """What a checkpoint (durable or in memory) holds of this rank: its model and optimizer shards, the step, the data
    position and its RNG states; `metrics` (rank 0): the metric points it keeps for a resumed run to replay, as a
    JSON array (RankMetrics.for_checkpoint_json)."""
    model_state, optimizer_state = _merged_state(model_parts, optimizers)
    return {"model": model_state, "optimizer": optimizer_state, **step_state(step, position, metrics)}


def step_state(step: int, position: DataPosition, metrics: str | None = None) -> dict[str, Any]:
    """The part of ``training_state`` that is not the model's or optimizer's: progress, RNG states, metric points."""
    state = {
        "progress": {"step": step, "epoch": position.epoch, "samples_in_epoch": position.samples_in_epoch},
        "rng": {f"rank{dist.get_rank()}": _rng_state()},
    }
    if metrics is not None:
        state["metrics"] = metrics
    return state


def load_training_state(
    reader: StorageReader,
    *,
    model_parts: list[nn.Module],
    optimizers: list[Optimizer],
    plan_locally: bool = False,
    state: dict[str, Any] | None = None,
) -> tuple[TrainingProgress, list[dict[str, Any]]]:
    """Collective: restore ``training_state`` from a DCP reader (resharded to this group by DCP's planner); returns the
    progress and the metric points it kept ([] when it kept none). `plan_locally`: each rank plans its own reads,
    with none of DCP's collectives (whose gathering of every rank's pickled plan is most of a small model's restore
    time): for a reader that has every file this rank needs at hand. `state`: the ``load_state_template`` already
    made for this reader's metadata, if any."""
    if state is None:
        state = load_state_template(reader.read_metadata().state_dict_metadata, model_parts, optimizers)
    dcp.load(state, storage_reader=reader, no_dist=plan_locally)
    for part, optimizer in zip(model_parts, optimizers, strict=True):
        local = local_optimizer(optimizer)
        configured = [_hyperparameters(group) for group in local.param_groups]
        set_state_dict(
            part,
            local,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=_LOAD_PART_OPTIONS,
        )
        # The saved state brings the saving run's hyperparameters too (weight decay, betas, each group's own): this
        # run's spec sets them, as for a job resumed from another job's checkpoint after a change of no_decay.
        for group, values in zip(local.param_groups, configured, strict=True):
            group.update(values)
    _restore_rng_state(state["rng"][f"rank{dist.get_rank()}"])
    progress = state["progress"]
    return (
        TrainingProgress(progress["step"], DataPosition(progress["epoch"], progress["samples_in_epoch"])),
        json.loads(state["metrics"]) if "metrics" in state else [],
    )


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's settings, without its parameters."""
    return {key: value for key, value in group.items() if key != "params"}


def load_state_template(saved_keys: Any, model_parts: list[nn.Module], optimizers: list[Optimizer]) -> dict[str, Any]:
    """The state dict DCP loads into: this rank's live tensors, and placeholders for what a checkpoint with
    `saved_keys` (its metadata's state_dict_metadata) holds besides."""
    rank = dist.get_rank()
    model_state, optimizer_state = _merged_state(model_parts, optimizers)
    # A rank that did not exist when the checkpoint was written keeps its freshly seeded RNG.
    rng_state = {name: value for name, value in _rng_state().items() if f"rng.rank{rank}.{name}" in saved_keys}
    state: dict[str, Any] = {
        "model": model_state,
        "optimizer": optimizer_state,
        "progress": {"step": 0, "epoch": 0, "samples_in_epoch": 0},
        "rng": {f"rank{rank}": rng_state},
    }
    if "metrics" in saved_keys:
        state["metrics"] = ""
    return state


def _merged_state(model_parts: list[nn.Module], optimizers: list[Optimizer]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and flattened optimizer state of all this rank's parts, keyed by the unsplit model's FQNs."""
    model_state: dict[str, Any] = {}
    optimizer_state: dict[str, Any] = {}
    for part, optimizer in zip(model_parts, optimizers, strict=True):
        part_model, part_optimizer = get_state_dict(part, local_optimizer(optimizer), options=_STATE_DICT_OPTIONS)
        model_state.update(part_model)
        optimizer_state.update(part_optimizer)
    return model_state, optimizer_state


def checkpoint_stager(device: torch.device) -> AsyncStager:
    """Stages asynchronous saves in a background thread, into host buffers kept from one save to the next (DCP's
    default stager allocates and first-touches a fresh copy of the whole state at every save, on the training
    thread). The copy overlaps the next step's forward and backward; `PendingSave.wait_staged` before the optimizer
    step. Close it when done."""
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=device.type == "cuda",
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=False,
        )
    )


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
