"""The optimizer step and the learning-rate schedule it follows.

The learning rate is a function of the step alone (warmup, then the JobSpec's train.lr_schedule), so a resumed run
needs no scheduler state. Gradient clipping (the
global norm across every shard and rank) belongs in `OptimizerStep.step`, between the schedule and the update.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch.optim import Optimizer

from ringmaster.service.spec import TrainSpec


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


class OptimizerStep:
    """Steps every optimizer of this rank's parts at the schedule's learning rate."""

    def __init__(self, optimizers: list[Optimizer], base_lr: float, lr_factor: Callable[[int], float]) -> None:
        self._optimizers = optimizers
        self._base_lr = base_lr
        self._lr_factor = lr_factor

    def step(self, completed_steps: int) -> float:
        """Update the parameters from their gradients for step ``completed_steps + 1``; returns the learning rate."""
        lr = self._base_lr * self._lr_factor(completed_steps)
        for optimizer in self._optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
        return lr

    def zero_grad(self) -> None:
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=True)
