"""The optimizer step: the global gradient norm and clipping, then the update at the learning rate of the schedule.

The learning rate is a function of the step alone (warmup, then the JobSpec's train.lr_schedule), so a resumed run
needs no scheduler state.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.optim import Optimizer

from ringmaster.service.spec import TrainSpec
from ringmaster.workers.strategies.parallel_model import LR_SCALE
from ringmaster.workers.torch_internals import foreach_mul_, foreach_norm


def linear_warmup(warmup_steps: int) -> Callable[[int], float]:
    """Learning-rate factor before step ``completed_steps + 1``: ramps linearly to 1 over ``warmup_steps``
    (the first step already moves), then stays."""

    def factor(completed_steps: int) -> float:
        return min(1.0, (completed_steps + 1) / warmup_steps) if warmup_steps else 1.0

    return factor


def lr_schedule(train: TrainSpec) -> Callable[[int], float]:
    """The factor of train.lr before step ``completed_steps + 1``: the linear warmup, then train.lr_schedule. A decay
    starts at 1 on the first step after the warmup and reaches min_lr_ratio on the last step."""
    warmup, schedule = linear_warmup(train.warmup_steps), train.lr_schedule
    decay_steps = train.steps - train.warmup_steps - 1  # steps after the first one past the warmup

    def factor(completed_steps: int) -> float:
        if completed_steps < train.warmup_steps or schedule.kind == "constant":
            return warmup(completed_steps)
        progress = min(1.0, (completed_steps - train.warmup_steps) / decay_steps) if decay_steps > 0 else 0.0
        floor = schedule.min_lr_ratio
        if schedule.kind == "linear":
            return 1.0 - (1.0 - floor) * progress
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def global_grad_norm(parameters: Iterable[torch.Tensor], pipeline_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The 2-norm of every gradient of the whole model, the one a single process computes, on every rank.

    A DTensor gradient (FSDP's shards, tensor parallel's pieces) contributes its full tensor's norm, reduced over its
    mesh; a plain one (DDP, or a tensor-parallel model's replicated parts) is the same on every rank that holds it and
    counts once. Pipeline stages hold different parameters, so their squared norms are summed over
    ``pipeline_group``."""
    plain: list[torch.Tensor] = []
    by_layout: dict[tuple[DeviceMesh, tuple[Placement, ...]], list[torch.Tensor]] = defaultdict(list)
    for parameter in parameters:
        grad = parameter.grad
        if isinstance(grad, DTensor):
            by_layout[(grad.device_mesh, grad.placements)].append(grad)
        elif grad is not None:
            plain.append(grad)
    norms: list[torch.Tensor] = []
    if plain:
        # One foreach kernel and one stack: get_total_norm adds a Python call per gradient (moving its norm to the
        # first one's device), which with the grouping doubled the cost of this, every step, on a small model's CPU.
        norms.append(torch.linalg.vector_norm(torch.stack(foreach_norm(plain, 2.0)), dtype=torch.float32))
    for members in by_layout.values():
        norm = torch.nn.utils.get_total_norm(members, norm_type=2.0)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float())
    if not norms:
        total = torch.zeros((), dtype=torch.float32)
    else:
        total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if pipeline_group is not None:
        squared = total.square()
        dist.all_reduce(squared, group=pipeline_group)
        total = squared.sqrt()
    return total


def clip_gradients(parameters: Iterable[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by max_norm / total_norm when that is below 1, as torch.nn.utils.clip_grad_norm_ does; a
    DTensor gradient is scaled through its local shard, so plain and DTensor gradients mix."""
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    local = [
        parameter.grad.to_local() if isinstance(parameter.grad, DTensor) else parameter.grad
        for parameter in parameters
        if parameter.grad is not None
    ]
    if local:
        foreach_mul_(local, coefficient.to(local[0].device))


class OptimizerStep:
    """Steps every optimizer of this rank's parts at the schedule's learning rate, after clipping the gradients to
    ``grad_clip`` (their global norm over every shard and rank) when one is set."""

    def __init__(
        self,
        optimizers: list[Optimizer],
        base_lr: float,
        lr_factor: Callable[[int], float],
        grad_clip: float | None = None,
        pipeline_group: dist.ProcessGroup | None = None,
        counted_elsewhere: Iterable[torch.Tensor] = (),
    ) -> None:
        """``counted_elsewhere``: parameters another stage also holds (tied across pipeline stages), whose gradient
        the norm takes from that stage only."""
        self._optimizers = optimizers
        self._base_lr = base_lr
        self._lr_factor = lr_factor
        self._grad_clip = grad_clip
        self._pipeline_group = pipeline_group
        # The parameter lists are fixed once the optimizers exist: found once here, not every step.
        self._parameters = [
            parameter for optimizer in optimizers for group in optimizer.param_groups for parameter in group["params"]
        ]
        elsewhere = {id(parameter) for parameter in counted_elsewhere}
        self._counted_here = [parameter for parameter in self._parameters if id(parameter) not in elsewhere]
        self.grad_norm: torch.Tensor | None = None  # of the last step, before clipping

    def clip(self) -> None:
        """The step's first half: the gradients' global norm (``grad_norm``), and clipping to it."""
        self.grad_norm = global_grad_norm(self._counted_here, self._pipeline_group)
        if self._grad_clip is not None:
            clip_gradients(self._parameters, self._grad_clip, self.grad_norm)

    def lr(self, completed_steps: int) -> float:
        return self._base_lr * self._lr_factor(completed_steps)

    def update(self, completed_steps: int) -> float:
        """The step's second half, after ``clip``: the optimizers' update for step ``completed_steps + 1`` at the
        schedule's learning rate, which it returns."""
        lr = self.lr(completed_steps)
        for optimizer in self._optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get(LR_SCALE, 1.0)
            optimizer.step()
        return lr

    def zero_grad(self) -> None:
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=True)
