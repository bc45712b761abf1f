"""This rank's endless, resumable stream of micro-batches, drawn from one global order per epoch.

Every step consumes the next global_batch_size samples of the epoch's shuffled order, however
many replicas share them, so the position is a count of samples, not of this rank's batches: a job
resumed at another world size continues exactly where it stopped, and every sample of an epoch is
used once — none skipped, none repeated.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.torch_internals import tree_map


@dataclass
class DataPosition:
    """Where the job's data stands: the epoch, and how many samples of its order all replicas have used."""

    epoch: int = 0
    samples_in_epoch: int = 0


def dataset_len(dataset: Dataset[Any]) -> int:
    """The length of a map-style dataset, as every dataset a job trains or validates on is (torch's Dataset declares
    no __len__)."""
    return len(cast(Sized, dataset))


def epoch_order(dataset_size: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's shuffled order of sample ids (the same permutation DistributedSampler draws)."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(dataset_size, generator=generator)


class GlobalBatchStream:
    """Micro-batches for one data-parallel replica.

    A global micro-step takes the next micro_batch_size × dp_size samples of the order; replica d
    takes the d-th slice. An epoch keeps only whole global batches, so which samples it uses does
    not depend on the world size. With ``num_workers`` > 0, DataLoader worker processes read and
    collate the micro-batches the stream's order names, ahead of time and in that order; the
    position counts only the micro-batches handed out, so it is the same as without workers.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        global_batch_size: int,
        position: DataPosition,
        pin_memory: bool = False,
        num_workers: int = 0,
    ) -> None:
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.samples_per_micro_step = micro_batch_size * dp_size
        self.seed = seed
        self.pin_memory = pin_memory
        size = dataset_len(dataset)
        self.samples_per_epoch = size // global_batch_size * global_batch_size
        if self.samples_per_epoch == 0:
            raise JobInputError(
                f"training set of {size} samples is smaller than one global batch of {global_batch_size}"
            )
        if position.samples_in_epoch % self.samples_per_micro_step:
            raise ValueError(
                f"data position {position.samples_in_epoch} is not on a micro-step boundary of "
                f"{self.samples_per_micro_step}"
            )
        self.position = DataPosition(position.epoch, position.samples_in_epoch)
        self._order = epoch_order(size, seed, self.position.epoch)
        self.last_sample_ids: list[int] = []
        self._loaded: Iterator[tuple[list[int], Any]] | None = None
        if num_workers:
            # The loader's own copy of the stream, started at the same position, names the ids its workers fetch.
            ahead = GlobalBatchStream(
                dataset,
                micro_batch_size=micro_batch_size,
                dp_rank=dp_rank,
                dp_size=dp_size,
                seed=seed,
                global_batch_size=global_batch_size,
                position=self.position,
            )
            loader = DataLoader(
                _MicroBatches(dataset),
                batch_size=None,
                sampler=_UpcomingIds(ahead),
                num_workers=num_workers,
                collate_fn=_as_fetched,  # type: ignore[arg-type]  # batch_size=None: it gets one item, not a list
                pin_memory=pin_memory,
            )
            self._loaded = iter(loader)

    def next_batch(self) -> Any:
        self.last_sample_ids = self._next_ids()
        if self._loaded is None:
            batch = _collated(self.dataset, self.last_sample_ids)
            return (
                tree_map(lambda value: value.pin_memory() if isinstance(value, torch.Tensor) else value, batch)
                if self.pin_memory
                else batch
            )
        fetched_ids, batch = next(self._loaded)
        if fetched_ids != self.last_sample_ids:
            raise RuntimeError(
                f"the data loader fetched samples {fetched_ids}, but the stream's order names {self.last_sample_ids}"
            )
        return batch

    def close(self) -> None:
        """Stop the DataLoader's worker processes (a stream without workers has none)."""
        if self._loaded is not None:
            self._loaded._shutdown_workers()  # type: ignore[attr-defined]
            self._loaded = None

    def _next_ids(self) -> list[int]:
        if self.position.samples_in_epoch + self.samples_per_micro_step > self.samples_per_epoch:
            self.position = DataPosition(self.position.epoch + 1, 0)
            self._order = epoch_order(dataset_len(self.dataset), self.seed, self.position.epoch)
        start = self.position.samples_in_epoch + self.dp_rank * self.micro_batch_size
        ids = self._order[start : start + self.micro_batch_size].tolist()
        self.position.samples_in_epoch += self.samples_per_micro_step
        return ids


def _collated(dataset: Dataset[Any], ids: list[int]) -> Any:
    return default_collate([dataset[index] for index in ids])


class _UpcomingIds(Sampler[list[int]]):
    """The ids of every micro-batch from the stream's position on, endlessly (epoch after epoch)."""

    def __init__(self, stream: GlobalBatchStream) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self._stream._next_ids()


class _MicroBatches(Dataset[tuple[list[int], Any]]):
    """Indexed by a micro-batch's list of ids: a worker reads and collates the whole micro-batch, and hands back
    the ids with it so the stream can check that what arrives is what its order names."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __getitem__(self, ids: list[int]) -> tuple[list[int], Any]:
        return ids, _collated(self.dataset, ids)


def _as_fetched(item: tuple[list[int], Any]) -> tuple[list[int], Any]:
    return item
