"""Bytes of training state one rank holds, measured from its own tensors (local shards only), so
the planner's predictions can be checked against what each strategy really keeps."""

from __future__ import annotations

import torch

from ringmaster.service.reports import RankMemory
from ringmaster.workers.parallel_dims import ParallelDims
from ringmaster.workers.strategies import ParallelModel
from ringmaster.workers.strategies.parallel_model import local_tensor
from ringmaster.workers.strategies.zero1 import local_optimizer


def measure_rank_memory(rank: int, parallel: ParallelModel, dims: ParallelDims, parameter_count: int) -> RankMemory:
    """Call after an optimizer step and before zero_grad, when parameters, gradients and state all exist."""
    parameters = list({id(p): p for part in parallel.parts for p in part.parameters()}.values())
    optimizer_tensors = [
        value
        for optimizer in parallel.optimizers
        for state in local_optimizer(optimizer).state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    return RankMemory(
        rank=rank,
        parameter_count=parameter_count,
        parameters_bytes=sum(_local_bytes(p) for p in parameters),
        gradients_bytes=sum(_local_bytes(p.grad) for p in parameters if p.grad is not None),
        optimizer_bytes=sum(_local_bytes(t) for t in optimizer_tensors),
        dp=dims.dp,
        tp=dims.tp,
        pp=dims.pp,
    )


def _local_bytes(tensor: torch.Tensor) -> int:
    local = local_tensor(tensor)
    return local.numel() * local.element_size()
