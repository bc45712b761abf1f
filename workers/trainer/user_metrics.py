"""The metrics of a user's own that a model's loss_fn returns beside its loss, ``(loss, {"accuracy": acc})``.

Each step's value of a metric is its mean over the step's micro-batches and data-parallel ranks, as the loss's is: its
sums ride in the step's one all-reduce, after the loss's. That needs the same names, in the same order, on every rank:
the first step agrees on them once, and a later step that returns other names fails the job rather than mis-average.
Validation reports each one's mean over the validation set as val_<name>, beside val_loss, in the same way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ringmaster.service.reports import MAX_USER_METRICS, USER_METRIC_NAME, VALIDATION_PREFIX, MetricPoint
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
    if name.startswith(VALIDATION_PREFIX):
        raise JobInputError(
            f"the model's {function} returned a metric named {name!r}: ringmaster reports a metric's value over the "
            f"validation set as {VALIDATION_PREFIX}<name> itself, so name it otherwise"
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
            self._names = _agreed_names(self._returned, "loss_fn")
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

    def each(self, microbatches: int) -> list[dict[str, torch.Tensor]]:
        """What the schedule step's `microbatches` micro-batches returned, in order (the last calls since `clear`: a
        schedule's first step also calls the loss on the outputs of its shape inference)."""
        returned, self._returned = self._returned[-microbatches:] if microbatches else [], []
        return returned

    def mean(self, microbatches: int) -> dict[str, torch.Tensor]:
        """The mean over the schedule step's `microbatches` micro-batches, by name."""
        returned = self.each(microbatches)
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


class ValidationUserMetrics:
    """A rank's sums of the user's metrics over its share of the validation set, each batch's value weighted by the
    samples it counts (as the loss is), and their place in the evaluation's one all-reduce, after the loss's.

    The names are agreed once, at the first evaluation (collective), as the training steps' are. A rank whose loss_fn
    returns other names after that, or other names from one batch to the next, votes in the all-reduce, and every
    rank fails alike rather than mis-average or leave the others waiting."""

    def __init__(self, device: torch.device, function: str = "loss_fn") -> None:
        """`function`: the model's function that returns them (a pipeline's is output_loss_fn)."""
        self._device, self._function = device, function
        self._names: tuple[str, ...] | None = None  # agreed at the first evaluation; sorted
        self._returned: tuple[str, ...] | None = None  # what this rank's loss_fn returned this evaluation
        self._changed = False  # this evaluation's batches returned different names on this rank
        self._sums: dict[str, torch.Tensor] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return self._names or ()

    def start(self) -> None:
        """A new evaluation."""
        self._returned, self._changed, self._sums = None, False, {}

    def add(self, metrics: dict[str, torch.Tensor], samples: int) -> None:
        """One (micro-)batch's metrics, each its mean over the batch, which counts `samples` samples (0: padding)."""
        returned = tuple(sorted(metrics))
        if self._returned is not None and returned != self._returned:
            self._changed = True
        self._returned = self._returned if self._returned is not None else returned
        if not samples:
            return  # padding: its values count for nothing, and a non-finite one must not poison the sums
        for name, value in metrics.items():
            weighted = value.to(self._device, torch.float64) * samples
            self._sums[name] = self._sums[name] + weighted if name in self._sums else weighted

    def into(self, totals: torch.Tensor) -> torch.Tensor:
        """`totals` (the evaluation's built-in sums) with this rank's vote that its names differ, then its sums, to
        all-reduce. The first evaluation agrees on the names first (collective)."""
        if self._names is None:
            self._names = _agreed_names(self._returned, self._function, " on the validation set")
        differs = self._changed or (self._returned is not None and self._returned != self._names)
        sums = [self._sums.get(name, totals.new_zeros(())) for name in self._names]
        return torch.cat([totals, totals.new_full((1,), float(differs)), *[value.reshape(1) for value in sums]])

    def means(self, reduced: list[float], samples: float) -> dict[str, float]:
        """Each metric's mean over the validation set from the all-reduced vote and sums after the built-in ones; a
        non-finite value is left out."""
        if reduced[0] > 0:
            raise JobInputError(
                f"the model's {self._function} returned other metrics on the validation set than "
                f"{list(self.names)}, on some rank or batch: it must return the same names for every batch and on "
                "every rank"
            )
        means = {name: total / samples for name, total in zip(self.names, reduced[1:])}
        return {name: value for name, value in means.items() if math.isfinite(value)}


def _agreed_names(returned: tuple[str, ...] | None, function: str, where: str = "") -> tuple[str, ...]:
    """Collective: the names every loss-holding rank returned (`returned`: this rank's, None where it holds no loss),
    which must be the same. Every rank judges the same gathered names, so all fail alike and none is left waiting."""
    gathered: list[tuple[str, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, returned)
    distinct = {names for names in gathered if names is not None}
    if len(distinct) > 1:
        by_rank = "; ".join(f"rank {rank}: {list(names)}" for rank, names in enumerate(gathered) if names is not None)
        raise JobInputError(
            f"the model's {function} returned different metrics{where} on different ranks ({by_rank}): it must "
            "return the same names on every rank"
        )
    agreed = distinct.pop() if distinct else ()
    if len(agreed) > MAX_USER_METRICS:
        raise JobInputError(
            f"the model's {function} returned {len(agreed)} metrics: a job reports at most {MAX_USER_METRICS}"
        )
    return agreed
