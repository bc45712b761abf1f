"""What the controller drives, as it sees it: the worker group, the attempt's bundles, the standby pool and one
training call's poll. The live ones act on Ray (worker_group.py, bundles.py, standby.py, poll.py); the job's
entrypoint (__main__.py) builds them and hands them to the controller, and its unit tests hand it fakes
(tests/workers/driver/test_controller.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ringmaster.workers.driver.bundles import Slot
from ringmaster.workers.driver.poll import PollResult
from ringmaster.workers.driver.worker_group import RankedWorker


class Group(Protocol):
    """The job's worker actors, formed into one generation of the process group after another."""

    workers: list[RankedWorker]  # the formed group's, in rank order
    generation: int
    pooled_started: int  # workers taken from the cluster's warm pool, over the whole run

    @property
    def world_size(self) -> int: ...
    @property
    def nodes(self) -> list[str]: ...

    def launch(self, slots: list[Slot], timeout_s: float) -> list[RankedWorker]:
        """A running worker on each slot; those not running within timeout_s are left out."""

    def form(self, members: list[RankedWorker]) -> None:
        """Rank the members and join them into the next generation; raises RayActorError when one died meanwhile."""

    def train(
        self,
        job_id: str,
        storage_root: str,
        resume_from_root: str | None = None,
        attempt: int = 1,
        resume_snapshot: dict[str, int] | None = None,
    ) -> dict[Any, RankedWorker]:
        """Start every member's training call; returns each call's ref and its worker."""

    def snapshot_inventories(self, job_id: str) -> list[list[dict[str, Any]]]: ...

    def unresponsive(
        self, timeout_s: float, grace_s: float, workers: list[RankedWorker] | None = None
    ) -> list[RankedWorker]: ...

    def remove(self, lost: list[RankedWorker]) -> None: ...
    def request_stop(self) -> None: ...
    def shutdown(self) -> None: ...


class JobBundles(Protocol):
    """The attempt's placement-group bundles: where workers may run."""

    lost_nodes: set[str]

    @property
    def admission(self) -> list[Slot]: ...

    def spare(self, taken: set[Slot]) -> list[Slot]:
        """Free bundles on live nodes now."""

    def spare_capacity(self) -> int:
        """How many more workers unreserved resources could hold now."""

    def release(self) -> None: ...


class Standbys(Protocol):
    """Warm workers outside the group: standbys, and the workers the group will grow by."""

    ready: list[RankedWorker]

    @property
    def starting(self) -> int: ...
    @property
    def slots(self) -> list[Slot]: ...

    def top_up(self, wanted: int, taken: set[Slot]) -> list[RankedWorker]:
        """One step toward `wanted` warm workers; returns those that became ready since the last call."""

    def wait_for_starting(self, timeout_s: float) -> None: ...

    def take(self, count: int, timeout_s: float) -> list[RankedWorker]:
        """Up to `count` live standbys, off the lost nodes."""

    def shutdown(self) -> None: ...


class TrainingPoll(Protocol):
    """One training call of the group, looked at once per controller iteration."""

    def poll(self, metrics_acknowledged: int) -> PollResult: ...

    def settle_interrupted(self, timeout_s: float) -> None: ...

    def drain(self, metrics_acknowledged: int) -> list[tuple[RankedWorker, dict[str, list[dict[str, Any]]]]]: ...


# Starts polling the group's training call: the group and the call's refs (Group.train's).
StartPoll = Callable[[Group, dict[Any, RankedWorker]], TrainingPoll]
