"""The validation loss: evaluated over the validation set, sharded over data-parallel ranks, once per step at most."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.models.registry import LossFn
from ringmaster.workers.strategies import ParallelModel
from ringmaster.workers.trainer.batches import first_stage_inputs, to_device

VALIDATION_BATCH_SIZE = 64  # no backward pass, so larger than a training micro-batch is cheap


class Validator:
    def __init__(self, parallel: ParallelModel, loss_fn: LossFn, dataset: Dataset, device: torch.device,
                 autocast: torch.autocast, *, dp_rank: int, dp: int, pipeline_batch_size: int, num_workers: int = 0) -> None:
        self._parallel = parallel
        self._loss_fn = loss_fn
        self._dataset = dataset
        self._device = device
        self._autocast = autocast
        self._dp_rank, self._dp = dp_rank, dp
        self._pipeline_batch_size = pipeline_batch_size
        self._num_workers = num_workers
        self._evaluated: tuple[int, float] | None = None  # (step, value): the end of training reuses a checkpoint's

    def loss_at(self, step: int) -> tuple[float, bool]:
        """Collective: the validation loss after `step`, and whether it was evaluated now (False: reused)."""
        if self._evaluated is not None and self._evaluated[0] == step:
            return self._evaluated[1], False
        value = self._evaluate()
        self._evaluated = (step, value)
        return value, True

    @torch.no_grad()
    def _evaluate(self) -> float:
        """Mean loss over the validation set; all ranks run the same number of batches (drop_last drops fewer than dp
        samples) so sharded strategies cannot hang. Under a pipeline every batch must have the training shape, so a
        last partial batch is left out."""
        parallel, dataset = self._parallel, self._dataset
        pipelined = parallel.schedule is not None
        batch_size = self._pipeline_batch_size if pipelined else VALIDATION_BATCH_SIZE
        sampler = DistributedSampler(dataset, num_replicas=self._dp, rank=self._dp_rank, shuffle=False, drop_last=True)
        # A private generator: evaluating between training steps must not draw from the training RNG.
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=pipelined, generator=torch.Generator(),
                            num_workers=self._num_workers)
        batch_sizes = (min(batch_size, len(sampler) - start) for start in range(0, len(sampler), batch_size))
        totals = torch.zeros(2, dtype=torch.float64, device=self._device)  # [sum of per-sample losses, samples]
        for part in parallel.parts:
            part.eval()
        for batch, samples in zip(loader, batch_sizes):
            batch = to_device(batch, self._device)
            with self._autocast:
                if pipelined:
                    inputs, targets = batch
                    losses: list[torch.Tensor] = []
                    parallel.schedule.eval(*first_stage_inputs(parallel, inputs), target=targets, losses=losses)
                    batch_loss = torch.stack(losses).mean() if parallel.holds_loss else None
                else:
                    batch_loss = self._loss_fn(parallel.parts[0], batch)
            if parallel.holds_loss:
                totals[0] += batch_loss.double() * samples
                totals[1] += samples
        for part in parallel.parts:
            part.train()
        dist.all_reduce(totals)
        summed, samples = totals.tolist()
        if samples == 0:
            raise JobInputError(f"validation set of {len(dataset)} samples holds no full batch of {batch_size} for each of "
                             f"{self._dp} data-parallel ranks")
        return summed / samples
