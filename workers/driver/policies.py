"""The driver's decisions, each a small object that looks at counts and returns a decision; the controller acts on
it. Pure: unit-tested against a fake worker group (tests/workers/driver/test_policies.py).

- FailurePolicy: what a broken run means: recover (workers lost, or a collective failed with everyone alive), or fail
  the job (the user's code raised: with its traceback; the job's input cannot be used, a JobInputError: with its
  message alone). How many recoveries a job may have is counted in one place, by the control plane
  (service/jobs.py), which answers a recovery past max_failures by ending the attempt.
- ScalingPolicy: at what size to (re-)form the group (FormGroup.size: the controller forms exactly that many),
  whether to wait for workers still warming up or for capacity, when to give up, and when a training group should
  stop at a step boundary to grow.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ray.exceptions import RayTaskError

from ringmaster.service.spec import WorkersSpec
from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.rank_process import TRAINING_PROCESS_NOTE

# Text of the exceptions a rank raises when a peer or the transport is gone, not the user's code.
_COMMUNICATION_FAILURES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistBackendError",
    "DistNetworkError",
    "NCCL error",
    "Timed out",
    "timed out",
    "aborted",
)


def is_communication_failure(error: BaseException) -> bool:
    text = str(error)
    return any(marker in text for marker in _COMMUNICATION_FAILURES)


@dataclass(frozen=True)
class Recover:
    """Keep the survivors and re-form the group without the lost workers."""

    reason: str


@dataclass(frozen=True)
class FailJob:
    reason: str


class LostWorker(Protocol):
    rank: int
    node_id: str


class FailurePolicy:
    def decide(self, lost: Sequence[LostWorker], errors: list[RayTaskError]) -> Recover | FailJob:
        if lost:
            nodes = sorted({worker.node_id[:12] for worker in lost})
            return Recover(f"lost rank(s) {sorted(worker.rank for worker in lost)} on node(s) {nodes}")
        rejected = [error.cause for error in errors if isinstance(getattr(error, "cause", None), JobInputError)]
        if rejected:  # the job's input, which every later attempt would meet as well: its message alone
            return FailJob(rejected[0].reason)
        if all(is_communication_failure(error) for error in errors):
            return Recover(f"a collective failed with every worker alive: {str(errors[0])[-300:]}")
        return FailJob(describe_task_error(next(error for error in errors if not is_communication_failure(error))))


_TRAINING_PROCESS_NOTE = re.compile(rf"{re.escape(TRAINING_PROCESS_NOTE)} \((?P<where>[^)]*)\):\n")
_RAY_TASK_NODE = re.compile(r"\bip=(?P<ip>[^,)]+)")


def describe_task_error(error: BaseException) -> str:
    """The remote traceback as plain text, headed by where it was raised: of a worker's training process, its rank,
    pid and node, and the training process's own traceback (its note), without the actor's frames that handed the
    call on; else Ray's account of the actor's call and its traceback."""
    where, _, frames = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).partition("\n")
    noted = _TRAINING_PROCESS_NOTE.search(frames)
    if noted is None:
        return f"training raised an exception in {where.strip()}\nTraceback (most recent call last):\n{frames}"
    node = _RAY_TASK_NODE.search(where)
    return (
        f"training raised an exception on {noted['where']}{f', node {node[1]}' if node else ''}\n"
        f"Traceback (most recent call last):\n{frames[noted.end() :]}"
    )


class GroupCounts(Protocol):
    """What the scaling policy looks at: the group's size and the warm workers beside it."""

    @property
    def world_size(self) -> int: ...
    @property
    def warm_ready(self) -> int: ...
    @property
    def warm_starting(self) -> int: ...


@dataclass(frozen=True)
class FormGroup:
    size: int


@dataclass(frozen=True)
class WaitForCapacity:
    pass


@dataclass(frozen=True)
class GiveUp:
    reason: str


class ScalingPolicy:
    def __init__(self, workers: WorkersSpec, capacity_wait_s: float) -> None:
        self.workers = workers
        self.capacity_wait_s = capacity_wait_s

    def missing(self, group: GroupCounts) -> int:
        return self.workers.max - group.world_size

    def warm_wanted(self, group: GroupCounts) -> int:
        """Warm workers to keep beside the group: those it would grow by, plus the standbys the spec asks for."""
        return self.missing(group) + self.workers.standby

    def should_grow(self, group: GroupCounts) -> bool:
        """Below max with warm workers: all that are missing, or all that could be started."""
        missing, warm = self.missing(group), group.warm_ready
        return missing > 0 and warm > 0 and (warm >= missing or not group.warm_starting)

    def wait_for_warming(self, group: GroupCounts) -> bool:
        """Too few to train on: the workers warming up are the quickest to come."""
        return group.world_size + group.warm_ready < self.workers.min and group.warm_starting > 0

    def new_workers_wanted(self, survivors: int, standbys: int) -> int:
        """New workers to start for a re-formation: none once the group reaches min (it trains, and the missing ones
        warm up meanwhile and join when ready), else enough to reach max."""
        if survivors + standbys >= self.workers.min:
            return 0
        return self.workers.max - survivors - standbys

    def formation(self, available: int) -> FormGroup | None:
        """The group `available` workers form now (at most max of them); None below min."""
        if available < self.workers.min:
            return None
        return FormGroup(min(self.workers.max, available))

    def decide(self, available: int, waited_s: float, reason: str) -> FormGroup | WaitForCapacity | GiveUp:
        """Form with what is available now, wait for capacity, or give up once min cannot be placed in time."""
        if (formation := self.formation(available)) is not None:
            return formation
        if waited_s <= self.capacity_wait_s:
            return WaitForCapacity()
        return GiveUp(f"{reason}; only {available} of workers.min {self.workers.min} can be placed")
