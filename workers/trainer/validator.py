"""The validation loss, and the user's metrics beside it: evaluated over the whole validation set, sharded over
data-parallel ranks, once per step at most."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from ringmaster.workers.data.stream import dataset_len
from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.models.registry import LossFn
from ringmaster.workers.strategies import ParallelModel
from ringmaster.workers.trainer.batches import first_stage_inputs, to_device
from ringmaster.workers.trainer.user_metrics import PipelineLossMetrics, ValidationUserMetrics, split_loss

VALIDATION_BATCH_SIZE = 64  # no backward pass, so larger than a training micro-batch is cheap
_BUILT_IN_TOTALS = 2  # [sum of per-sample losses, samples], before the user's metrics' vote and sums


@dataclass(frozen=True)
class Evaluation:
    """The means over the validation set: the loss, and each metric the loss_fn returns beside it by its name (not
    yet val_<name>; a non-finite one left out)."""

    loss: float
    user_metrics: dict[str, float] = field(default_factory=dict)


class Validator:
    def __init__(
        self,
        parallel: ParallelModel,
        loss_fn: LossFn,
        dataset: Dataset[Any],
        device: torch.device,
        autocast: torch.autocast,
        *,
        dp_rank: int,
        dp: int,
        micro_batch_size: int,
        microbatches: int,
        num_workers: int = 0,
        pipeline_metrics: PipelineLossMetrics | None = None,
    ) -> None:
        """`micro_batch_size`, `microbatches`: a pipeline's batch shape, `microbatches` micro-batches a step;
        `pipeline_metrics`: where a pipeline's wrapped output_loss_fn keeps the metrics it returned."""
        self._parallel = parallel
        self._loss_fn = loss_fn
        self._dataset = dataset
        self._device = device
        self._autocast = autocast
        self._dp_rank, self._dp = dp_rank, dp
        self._pipeline_batch_size, self._microbatches = micro_batch_size * microbatches, microbatches
        self._num_workers = num_workers
        self._pipeline_metrics = pipeline_metrics or PipelineLossMetrics()
        pipelined = parallel.schedule is not None
        self._user_metrics = ValidationUserMetrics(device, "output_loss_fn" if pipelined else "loss_fn")
        self._evaluated: tuple[int, Evaluation] | None = None  # the end of training reuses a checkpoint's

    @property
    def user_metric_names(self) -> tuple[str, ...]:
        """The names of the metrics the loss_fn returns on the validation set, once an evaluation agreed on them."""
        return self._user_metrics.names

    def at(self, step: int) -> tuple[Evaluation, bool]:
        """Collective: the validation after `step`, and whether it was evaluated now (False: reused)."""
        if self._evaluated is not None and self._evaluated[0] == step:
            return self._evaluated[1], False
        evaluation = self._evaluate()
        self._evaluated = (step, evaluation)
        return evaluation, True

    @torch.no_grad()
    def _evaluate(self) -> Evaluation:
        """The mean loss and user's metrics over every sample of the validation set, whatever the strategy and world
        size (which a resize changes): each data-parallel rank takes every dp-th sample, and every rank runs the same
        number of batches (sharded strategies gather in each forward), those past its own samples counting for
        nothing. Each metric is weighted by the samples a batch counts, as the loss is, and rides in the loss's one
        all-reduce."""
        parallel, dataset = self._parallel, self._dataset
        if dataset_len(dataset) == 0:
            raise JobInputError("the validation set holds no samples")
        schedule = parallel.schedule
        pipelined = schedule is not None
        batches = validation_batches(
            dataset_len(dataset),
            self._dp,
            self._dp_rank,
            self._pipeline_batch_size if pipelined else VALIDATION_BATCH_SIZE,
            self._microbatches if pipelined else None,
        )
        # A private generator: the loader draws a seed for its workers, and evaluating between training steps must not
        # draw from the training RNG.
        loader = DataLoader(
            dataset,
            batch_sampler=[ids for ids, _ in batches],
            generator=torch.Generator(),
            num_workers=self._num_workers,
        )
        totals = torch.zeros(_BUILT_IN_TOTALS, dtype=torch.float64, device=self._device)
        user_metrics = self._user_metrics
        user_metrics.start()
        for part in parallel.parts:
            part.eval()
        for batch, (_, counted) in zip(loader, batches):
            batch = to_device(batch, self._device)
            with self._autocast:
                if schedule is not None:  # pipelined
                    inputs, targets = batch
                    losses: list[torch.Tensor] = []
                    self._pipeline_metrics.clear()
                    schedule.eval(*first_stage_inputs(parallel, inputs), target=targets, losses=losses)
                    returned = self._pipeline_metrics.each(len(losses))  # the last stage's, a dict per micro-batch
                else:
                    loss, metrics = split_loss(self._loss_fn(parallel.parts[0], batch))
                    losses, returned = [loss], [metrics]
            if parallel.holds_loss:
                totals[0] += sum(loss.double() * samples for loss, samples in zip(losses, counted) if samples)
                totals[1] += sum(counted)
                for metrics, samples in zip(returned, counted):
                    user_metrics.add(metrics, samples)
        for part in parallel.parts:
            part.train()
        totals = user_metrics.into(totals)
        dist.all_reduce(totals)
        reduced = totals.tolist()
        summed, samples = reduced[:_BUILT_IN_TOTALS]
        return Evaluation(summed / samples, user_metrics.means(reduced[_BUILT_IN_TOTALS:], samples))


def validation_batches(
    samples: int, dp: int, dp_rank: int, batch_size: int, microbatches: int | None
) -> list[tuple[list[int], list[int]]]:
    """The batches data-parallel rank `dp_rank` of `dp` evaluates, as (sample ids, samples counted in each of its
    micro-batches): it takes samples dp_rank, dp_rank + dp, …, and pads to the batch count of the rank with the most
    with batches that count nothing. Unpipelined (`microbatches` None) a batch is one micro-batch and the last may be
    short. A pipeline's every batch has its training shape, `microbatches` micro-batches of batch_size / microbatches
    samples: the samples that fill no whole batch each fill a micro-batch with copies of themselves, which in eval
    mode has that one sample's loss."""
    every_rank = [_batches_of(list(range(rank, samples, dp)), batch_size, microbatches) for rank in range(dp)]
    filler = ([0] * batch_size, [0] * microbatches) if microbatches is not None else ([0], [0])
    mine = every_rank[dp_rank]
    return mine + [filler] * (max(map(len, every_rank)) - len(mine))


def _batches_of(ids: list[int], batch_size: int, microbatches: int | None) -> list[tuple[list[int], list[int]]]:
    if microbatches is None:
        chunks = [ids[start : start + batch_size] for start in range(0, len(ids), batch_size)]
        return [(chunk, [len(chunk)]) for chunk in chunks]
    per_micro = batch_size // microbatches
    whole = len(ids) // batch_size * batch_size
    batches = [(ids[start : start + batch_size], [per_micro] * microbatches) for start in range(0, whole, batch_size)]
    tail = ids[whole:]
    for start in range(0, len(tail), microbatches):
        singles = tail[start : start + microbatches]
        padding = microbatches - len(singles)
        batches.append(
            (
                [sample for sample in singles for _ in range(per_micro)] + [0] * (padding * per_micro),
                [1] * len(singles) + [0] * padding,
            )
        )
    return batches
