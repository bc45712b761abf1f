"""This rank's endless, resumable stream of micro-batches, drawn from one global order per epoch.

Every step consumes the next global_batch_size samples of the epoch's shuffled order, however
many replicas share them, so the position is a count of samples, not of this rank's batches: a job
resumed at another world size continues exactly where it stopped, and every sample of an epoch is
used once — none skipped, none repeated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import Dataset, default_collate


@dataclass
class DataPosition:
    """Where the job's data stands: the epoch, and how many samples of its order all replicas have used."""

    epoch: int = 0
    samples_in_epoch: int = 0


def epoch_order(dataset_size: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's shuffled order of sample ids (the same permutation DistributedSampler draws)."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(dataset_size, generator=generator)


class GlobalBatchStream:
    """Micro-batches for one data-parallel replica.

    A global micro-step takes the next micro_batch_size × dp_size samples of the order; replica d
    takes the d-th slice. An epoch keeps only whole global batches, so which samples it uses does
    not depend on the world size.
    """

    def __init__(self, dataset: Dataset, *, micro_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 global_batch_size: int, position: DataPosition, pin_memory: bool = False) -> None:
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.samples_per_micro_step = micro_batch_size * dp_size
        self.seed = seed
        self.pin_memory = pin_memory
        self.samples_per_epoch = len(dataset) // global_batch_size * global_batch_size
        if self.samples_per_epoch == 0:
            raise ValueError(f"training set of {len(dataset)} samples is smaller than one global batch of {global_batch_size}")
        if position.samples_in_epoch % self.samples_per_micro_step:
            raise ValueError(f"data position {position.samples_in_epoch} is not on a micro-step boundary of {self.samples_per_micro_step}")
        self.position = DataPosition(position.epoch, position.samples_in_epoch)
        self._order = epoch_order(len(dataset), seed, self.position.epoch)
        self.last_sample_ids: list[int] = []

    def next_batch(self) -> Any:
        if self.position.samples_in_epoch + self.samples_per_micro_step > self.samples_per_epoch:
            self.position = DataPosition(self.position.epoch + 1, 0)
            self._order = epoch_order(len(self.dataset), self.seed, self.position.epoch)
        start = self.position.samples_in_epoch + self.dp_rank * self.micro_batch_size
        self.last_sample_ids = self._order[start : start + self.micro_batch_size].tolist()
        self.position.samples_in_epoch += self.samples_per_micro_step
        batch = default_collate([self.dataset[index] for index in self.last_sample_ids])
        return tree_map(lambda value: value.pin_memory() if isinstance(value, torch.Tensor) else value, batch) if self.pin_memory else batch
