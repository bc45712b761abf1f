"""The metrics of a user's own that a model's loss_fn returns beside its loss, ``(loss, {"accuracy": acc})``.

Each step's value of a metric is its mean over the step's micro-batches and data-parallel ranks, as the loss's is: its
sums ride in the step's one all-reduce, after the loss's. That needs the same names, in the same order, on every rank:
the first step agrees on them once, and a later step that returns other names fails the job rather than mis-average.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ringmaster.service.reports import MAX_USER_METRICS, USER_METRIC_NAME, MetricPoint
from ringmaster.workers.job_input import JobInputError

# The names ringmaster's own values take in a metric point, TensorBoard (train/<name>) and MLflow.
RESERVED_NAMES = frozenset(MetricPoint.model_fields) | {"recoveries"}
_RETURN = 'return the loss alone, or (loss, {"name": value, …}) with each value a number or a one-element tensor'


def split_loss(returned: Any, function: str = "loss_fn") -> tuple[Any, dict[str, torch.Tensor]]:
    """The loss and the user's metrics (detached, by name) in what the model's `function` returned: a loss alone, or
    ``(loss, {name: value})``. The loss itself is checked where it is trained on."""
    if not isinstance(returned, tuple):
        return returned, {}
    if len(returned) != 2 or not isinstance(returned[1], dict):
        described = ", ".join(type(item).__name__ for item in returned)
        raise JobInputError(f"the model's {function} returned a tuple of ({described}): {_RETURN}")
    loss, metrics = returned
    return loss, {
        _checked_name(name, function): _metric_value(name, value, function) for name, value in metrics.items()
    }


def _checked_name(name: Any, function: str) -> str:
    if not isinstance(name, str) or not re.fullmatch(USER_METRIC_NAME, name):
        raise JobInputError(
            f"the model's {function} returned a metric named {name!r}: a metric's name is 1 to 64 letters, digits, "
            "'_', '.', '-' or '/', starting with a letter"
        )
    if name in RESERVED_NAMES:
        raise JobInputError(
            f"the model's {function} returned a metric named {name!r}, which ringmaster reports itself: name it "
            "otherwise"
        )
    return name


def _metric_value(name: str, value: Any, function: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return value.detach().reshape(()).float()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return torch.tensor(float(value))
    shape = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    raise JobInputError(f"the model's {function} returned metric {name!r} as {shape}: {_RETURN}")


class StepUserMetrics:
    """A rank's sums of the user's metrics over a step's micro-batches, and their place in the step's all-reduce."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._names: tuple[str, ...] | None = None  # agreed at this training call's first step; sorted
        self._returned: tuple[str, ...] | None = None  # what this rank's loss_fn returned at that step (None: nothing)
        self._sums: dict[str, torch.Tensor] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return self._names or ()

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        """One micro-batch's metrics (its mean over the micro-batch), on a rank that holds losses."""
        returned = tuple(sorted(metrics))
        expected = self._names if self._names is not None else self._returned
        if expected is not None and returned != expected:
            raise JobInputError(
                f"the model's loss_fn returned metrics {list(returned)} after returning {list(expected)}: it must "
                "return the same names at every step"
            )
        self._returned = returned
        for name, value in metrics.items():
            value = value.to(self._device, non_blocking=True)
            self._sums[name] = self._sums[name] + value if name in self._sums else value

    def into(self, stats: torch.Tensor, built_in: int) -> torch.Tensor:
        """`stats` (whose first `built_in` entries are the trainer's) with this step's sums after them, to all-reduce.
        The first step widens it, once every rank has said what its loss_fn returned (collective)."""
        if self._names is None:
            self._names = self._agreed_names()
            stats = torch.cat([stats[:built_in], torch.zeros(len(self._names), device=stats.device)])
        if self._sums:
            stats[built_in:] = torch.stack([self._sums[name] for name in self._names])
        self._sums = {}
        return stats

    def means(self, reduced: list[float], count: int) -> dict[str, float] | None:
        """The step's metrics from the all-reduced sums after the trainer's stats (`count` micro-batches summed);
        a non-finite value (an overflowing perplexity) is left out. None: the loss_fn returns the loss alone."""
        if not self._names:
            return None
        means = {name: total / count for name, total in zip(self._names, reduced)}
        return {name: value for name, value in means.items() if math.isfinite(value)}

    def _agreed_names(self) -> tuple[str, ...]:
        """Collective, once: the names every loss-holding rank returned, which must be the same. Every rank judges the
        same gathered names, so all fail alike and none is left waiting in a collective."""
        returned: list[tuple[str, ...] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(returned, self._returned)
        distinct = {names for names in returned if names is not None}
        if len(distinct) > 1:
            by_rank = "; ".join(
                f"rank {rank}: {list(names)}" for rank, names in enumerate(returned) if names is not None
            )
            raise JobInputError(
                f"the model's loss_fn returned different metrics on different ranks ({by_rank}): it must return the "
                "same names on every rank"
            )
        agreed = distinct.pop() if distinct else ()
        if len(agreed) > MAX_USER_METRICS:
            raise JobInputError(
                f"the model's loss_fn returned {len(agreed)} metrics: a job reports at most {MAX_USER_METRICS}"
            )
        return agreed


class PipelineLossMetrics:
    """A pipeline schedule calls the loss itself, as ``output_loss_fn(outputs, targets)`` on the last stage for each
    micro-batch, and wants the loss alone: the metrics it returned beside it are kept here for the trainer."""

    def __init__(self) -> None:
        self._returned: list[dict[str, torch.Tensor]] = []

    def wrap(self, output_loss_fn: Callable[[torch.Tensor, Any], Any]) -> Callable[[torch.Tensor, Any], Any]:
        def loss_alone(outputs: torch.Tensor, targets: Any) -> Any:
            loss, metrics = split_loss(output_loss_fn(outputs, targets), "output_loss_fn")
            self._returned.append(metrics)
            return loss

        return loss_alone

    def clear(self) -> None:
        self._returned.clear()

    def mean(self, microbatches: int) -> dict[str, torch.Tensor]:
        """The mean over the schedule step's `microbatches` micro-batches (the last calls since `clear`: a schedule's
        first step also calls the loss on the outputs of its shape inference), by name."""
        returned, self._returned = self._returned[-microbatches:] if microbatches else [], []
        if not returned:
            return {}
        first = returned[0].keys()
        for metrics in returned[1:]:
            if metrics.keys() != first:
                raise JobInputError(
                    f"the model's output_loss_fn returned metrics {sorted(metrics)} after returning {sorted(first)}: "
                    "it must return the same names for every micro-batch"
                )
        return {name: torch.stack([metrics[name] for metrics in returned]).mean() for name in first}
