"""Moving a batch to the device, and which pipeline rank feeds it: shared by training and validation steps."""

from __future__ import annotations

from typing import Any

import torch

from ringmaster.workers.strategies import ParallelModel


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch


def first_stage_inputs(parallel: ParallelModel, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Only the rank holding stage 0 feeds inputs to the schedule; the others receive activations."""
    return (inputs,) if parallel.stages[0].is_first else ()
