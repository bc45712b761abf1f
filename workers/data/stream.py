"""This rank's endless, resumable stream of micro-batches: epochs roll over, the position is saved."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from torch.utils.data import DataLoader, Dataset, DistributedSampler


@dataclass
class DataPosition:
    """Where the stream stands: the epoch, and how many micro-batches of it this rank has taken."""

    epoch: int = 0
    batches_in_epoch: int = 0


class ShardedBatchStream:
    """Micro-batches of this rank's DistributedSampler shard (shuffled per epoch, drop_last).

    Only full micro-batches are served, so every rank takes the same number per epoch, and a
    stream started at a saved position yields exactly what an uninterrupted one would have.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        position: DataPosition,
        pin_memory: bool = False,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.pin_memory = pin_memory
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.batches_per_epoch = len(self.sampler) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"training set of {len(dataset)} samples is too small for one micro-batch of {batch_size} "
                f"on each of {world_size} ranks"
            )
        self.position = DataPosition(position.epoch, position.batches_in_epoch)
        self._batches = self._open_epoch()

    def next_batch(self) -> Any:
        if self.position.batches_in_epoch == self.batches_per_epoch:
            self.position.epoch += 1
            self.position.batches_in_epoch = 0
            self._batches = self._open_epoch()
        self.position.batches_in_epoch += 1
        return next(self._batches)

    def _open_epoch(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.position.epoch)
        indices = list(self.sampler)[self.position.batches_in_epoch * self.batch_size :]
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=indices, drop_last=True, pin_memory=self.pin_memory)
        return iter(loader)
