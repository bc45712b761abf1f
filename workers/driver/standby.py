"""Warm workers outside the process group: actors on spare capacity with the training stack imported.

Two uses. Standbys (JobSpec `workers.standby`): a worker lost with its node is replaced in the time
of a rendezvous rather than the seconds a new process takes to start and import torch. Growth: while
the group is below `workers.max`, the workers it will grow by warm up here while it trains, and join
only once warm, so the group never waits for a cold start it could train through. The capacity they
hold comes from the attempt's bundles (workers/driver/bundles.py), which release it when the job ends.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from ringmaster.workers.driver.bundles import Bundles, Slot
from ringmaster.workers.driver.worker_group import RankedWorker, WorkerGroup

log = logging.getLogger("ringmaster.standby")

LOOK_INTERVAL_S = 1.0  # how often to look for capacity while a standby is missing


class StandbyPool:
    """Keeps warm workers up to a wanted count; every call but `take` returns at once (the driver's loop polls it)."""

    def __init__(self, group: WorkerGroup, bundles: Bundles) -> None:
        self._group = group
        self._bundles = bundles
        self.ready: list[RankedWorker] = []
        self._starting: dict[Any, tuple[Any, Slot, Any]] = {}  # warm_up ref -> (actor, slot, placement ref)
        self._next_look = 0.0

    @property
    def slots(self) -> list[Slot]:
        """Slots the warm workers hold or are starting on: not free for growing the group."""
        return [worker.slot for worker in self.ready] + [slot for _, slot, _ in self._starting.values()]

    @property
    def starting(self) -> int:
        return len(self._starting)

    def top_up(self, wanted: int, taken: set[Slot]) -> list[RankedWorker]:
        """One step toward `wanted` warm workers (on spare bundles, else on idle capacity reserved for them); returns
        those that became ready since the last call. `taken`: the slots the group's workers hold. Cheap while nothing
        is missing: the driver calls it every poll."""
        became_ready = self._collect()
        missing = wanted - len(self.ready) - len(self._starting)
        if missing <= 0:
            return became_ready
        slots = self._bundles.reserved()
        if not slots and time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + LOOK_INTERVAL_S
            slots = self._bundles.spare(taken | set(self.slots))[:missing]
            if slots:
                self._bundles.cancel_reservation()
            if not self._bundles.reserving and len(slots) < missing and (spare := self._bundles.spare_capacity()) > 0:
                self._bundles.reserve(min(missing - len(slots), spare))
        if slots:
            log.info("warming %d worker(s)", len(slots))
        for actor, slot in self._group.start_actors(slots):
            self._starting[actor.warm_up.remote()] = (actor, slot, actor.placement.remote())
        return became_ready

    def _collect(self) -> list[RankedWorker]:
        if not self._starting:
            return []
        warm, _ = ray.wait(list(self._starting), num_returns=len(self._starting), timeout=0)
        before = len(self.ready)
        for ref in warm:
            actor, slot, placement_ref = self._starting.pop(ref)
            try:
                ray.get(ref)
                placement = ray.get(placement_ref)
            except RayActorError:
                continue  # died while starting (its node went): top_up starts another when capacity allows
            self.ready.append(RankedWorker.placed(actor, slot, placement))
        return self.ready[before:]

    def wait_for_starting(self, timeout_s: float) -> None:
        """Block until every worker still warming up is ready or gone, or timeout_s passes."""
        if self._starting:
            ray.wait(list(self._starting), num_returns=len(self._starting), timeout=timeout_s)
        self._collect()

    def take(self, count: int, timeout_s: float) -> list[RankedWorker]:
        """Up to `count` live standbys, off the lost nodes (a standby may have died with one). Those found dead are
        dropped; their slots are free again."""
        self._collect()
        candidates = [worker for worker in self.ready if worker.node_id not in self._bundles.lost_nodes]
        beats = {worker.actor.heartbeat.remote(): worker for worker in candidates}
        answered, _ = ray.wait(list(beats), num_returns=len(beats), timeout=timeout_s) if beats else ([], [])
        alive = []
        for ref in answered:
            try:
                ray.get(ref)
                alive.append(beats[ref])
            except RayActorError:
                pass
        alive.sort(key=candidates.index)
        taken = alive[:count]
        for worker in self.ready:
            if worker not in alive:
                ray.kill(worker.actor, no_restart=True)
        self.ready = [worker for worker in alive if worker not in taken]
        return taken

    def shutdown(self) -> None:
        for worker in self.ready:
            ray.kill(worker.actor, no_restart=True)
        for actor, _, _ in self._starting.values():
            ray.kill(actor, no_restart=True)
        self.ready, self._starting = [], {}
