"""The trainer's one interface to a group's in-memory snapshots (StepSnapshots), whichever kind the group takes: none
(NoSnapshots), copies of every step's state on buddies (PeerSnapshots), or the live state itself where every rank
holds all of it (LiveStateSnapshots). The trainer calls it at the same points of every step; the kind decides what
happens there, and in which order the step's end runs (StepEnd)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from ringmaster.workers.checkpoint.snapshots.store import SnapshotStore
from ringmaster.workers.data.stream import DataPosition


@dataclass(frozen=True)
class StepEnd:
    """The end of one training step, after the gradients' clipping, in parts the trainer gives and the snapshots put
    in order (StepSnapshots.end_step): the step's one all-reduce (its loss and stop votes, and this rank's vote that
    its state left the snapshots' layout), the optimizer update, and the step's count."""

    step: int  # the step this ends (the first is 1)
    position: DataPosition  # the data position after it
    last: bool  # the training's last step: the final checkpoint holds its state, and no snapshot follows it
    reduce: Callable[[bool], bool]  # the step's all-reduce, with this rank's vote; returns the group's vote
    reduce_during_update: Callable[[], None]  # the step's all-reduce (no vote) overlapping the optimizer update
    update: Callable[[], None]  # the optimizer update
    close: Callable[[], bool]  # count the step (its loss, samples, rank 0's metric point); True: stop after it
    metrics: Callable[[], str | None]  # rank 0: the metric points a snapshot keeps (JSON), once the step is counted


class StepSnapshots(ABC):
    """What the trainer calls on its group's in-memory snapshots."""

    takes_snapshots: ClassVar[bool] = True  # whether a snapshot keeps rank 0's unacknowledged metric points

    @abstractmethod
    def after_restore(self) -> None:
        """The group's state is restored, before its first step."""

    @abstractmethod
    def before_state_changes(self) -> None:
        """Before the optimizer changes the state."""

    @abstractmethod
    def end_step(self, end: StepEnd) -> bool:
        """Run the step's end in the order this kind needs, snapshotting the step; returns what `end.close` did."""

    @abstractmethod
    def training_ended(self, *, stopped: bool) -> None:
        """The group's training returned: all steps done, or `stopped` where the driver asked (the next group, which
        the driver forms now, may resume from the last snapshot)."""

    @abstractmethod
    def training_failed(self) -> None:
        """The group's training raised (a failure the driver recovers from, by a new group)."""


class NoSnapshots(StepSnapshots):
    """A group that takes no snapshots (checkpoint.in_memory off, or a group on one node): the step's all-reduce
    overlaps the optimizer update."""

    takes_snapshots = False

    def __init__(self, store: SnapshotStore | None, job_id: str) -> None:
        self._store, self._job_id = store, job_id

    def after_restore(self) -> None:
        # The process's snapshots of this job are older than the state restored: none may outlive it.
        if self._store is not None:
            self._store.drop(self._job_id)

    def before_state_changes(self) -> None:
        pass

    def end_step(self, end: StepEnd) -> bool:
        end.reduce_during_update()
        return end.close()

    def training_ended(self, *, stopped: bool) -> None:
        pass

    def training_failed(self) -> None:
        pass
