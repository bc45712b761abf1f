"""The optimizer step and the learning-rate schedule it follows.

The learning rate is a function of the step alone, so a resumed run needs no scheduler state. Gradient clipping (the
global norm across every shard and rank) belongs in `OptimizerStep.step`, between the schedule and the update.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.optim import Optimizer


def linear_warmup(warmup_steps: int) -> Callable[[int], float]:
    """Learning-rate factor before step ``completed_steps + 1``: ramps linearly to 1 over ``warmup_steps``
    (the first step already moves), then stays."""

    def factor(completed_steps: int) -> float:
        return min(1.0, (completed_steps + 1) / warmup_steps) if warmup_steps else 1.0

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
