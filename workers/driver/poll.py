"""One look at a training worker group: which training calls returned, which workers are gone (actor death, a missed
heartbeat, or silence in the probe after a failed collective), and what rank 0 recorded since the last drain."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray
from ray.exceptions import RayActorError, RayTaskError

from ringmaster.workers.driver.worker_group import RankedWorker

log = logging.getLogger("ringmaster.driver")


@dataclass
class PollResult:
    """What one poll saw. `finished`: every training call returned (their results); `lost` and `errors`: the run is
    broken; `drained`: what the workers handed over this poll (None: not drained this time)."""

    finished: list[dict[str, Any]] | None = None
    lost: list[RankedWorker] = field(default_factory=list)
    errors: list[RayTaskError] = field(default_factory=list)
    drained: list[tuple[RankedWorker, dict[str, list[dict[str, Any]]]]] | None = None

    @property
    def broken(self) -> bool:
        return bool(self.lost or self.errors)


class Heartbeats:
    """Heartbeats sent every interval; a worker whose oldest unanswered beat is older than timeout is lost."""

    def __init__(self, interval_s: float, timeout_s: float) -> None:
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._outstanding: dict[Any, tuple[RankedWorker, float]] = {}
        self._last_sent = 0.0

    @property
    def next_due(self) -> float:
        """When (time.monotonic) the next beats are sent."""
        return self._last_sent + self.interval_s

    def check(self, workers: list[RankedWorker]) -> list[RankedWorker]:
        now = time.monotonic()
        if self._outstanding:
            answered, _ = ray.wait(list(self._outstanding), num_returns=len(self._outstanding), timeout=0)
            for ref in answered:
                worker, _sent = self._outstanding.pop(ref)
                try:
                    ray.get(ref)
                except RayActorError:
                    return [worker]
        if now - self._last_sent >= self.interval_s:
            self._outstanding.update({worker.actor.heartbeat.remote(): (worker, now) for worker in workers})
            self._last_sent = now
        return sorted(
            {id(worker): worker for worker, sent in self._outstanding.values() if now - sent > self.timeout_s}.values(),
            key=lambda worker: worker.rank,
        )


class PolledGroup(Protocol):
    """What a poll looks at of the group (worker_group.py's WorkerGroup)."""

    workers: list[RankedWorker]

    def unresponsive(
        self, timeout_s: float, grace_s: float, workers: list[RankedWorker] | None = None
    ) -> list[RankedWorker]: ...


class GroupPoll:
    """Polls one training call of a group (one generation) until it finishes or breaks."""

    def __init__(
        self,
        group: PolledGroup,
        futures: dict[Any, RankedWorker],
        *,
        interval_s: float,
        drain_every_s: float,
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        probe_timeout_s: float,
        probe_grace_s: float,
    ) -> None:
        self._group = group
        self._futures = futures
        self._pending = list(futures)
        self._interval_s = interval_s
        self._drain_every_s = drain_every_s
        self._next_drain = time.monotonic() + drain_every_s
        self._heartbeats = Heartbeats(heartbeat_interval_s, heartbeat_timeout_s)
        self._probe = (probe_timeout_s, probe_grace_s)
        self.memory_pending = {worker.rank for worker in group.workers}  # ranks whose one memory report is still due

    def poll(self, metrics_acknowledged: int) -> PollResult:
        """Wait until a training call returns or ends (a dead actor's ends at once), at most until the heartbeats or
        the drain are due and one interval; check heartbeats; drain when due. A failed collective is followed by a
        probe of every worker, so a lost peer is told apart from an error in the user's code. (The driver shares
        the training's CPUs: it wakes a few times a second, not on a fixed fast tick.)"""
        result = PollResult()
        now = time.monotonic()
        timeout = min(self._interval_s, max(0.0, min(self._next_drain, self._heartbeats.next_due) - now))
        done: list[Any] = []
        errored: list[RankedWorker] = []  # whose call raised each of result.errors, in order
        if self._pending:
            done, self._pending = ray.wait(self._pending, num_returns=1, timeout=timeout)
        if done and self._pending:  # the others that ended meanwhile
            more, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=0)
            done += more
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError:
                result.lost.append(self._futures[ref])
            except RayTaskError as error:
                result.errors.append(error)
                errored.append(self._futures[ref])
        result.lost += [worker for worker in self._heartbeats.check(self._group.workers) if worker not in result.lost]
        if result.errors and not result.lost:
            probing = time.monotonic()
            result.lost = self._group.unresponsive(*self._probe)
            log.info(
                "a collective failed; probe found %d unresponsive worker(s) in %.2fs",
                len(result.lost),
                time.monotonic() - probing,
            )
        elif result.lost:
            log.info("lost %d worker(s): actor death or a missed heartbeat", len(result.lost))
        if result.lost:  # the survivors whose call the loss broke, seen ending before the loss was
            for worker, task_error in zip(errored, result.errors):
                _log_ended(worker, task_error)
        finished = not self._pending and not result.broken
        if finished or time.monotonic() >= self._next_drain:
            result.drained = self.drain(metrics_acknowledged)
            self._next_drain = time.monotonic() + self._drain_every_s
        if finished:
            result.finished = ray.get(list(self._futures))
        return result

    def settle_interrupted(self, timeout_s: float) -> None:
        """Take, in the background, the results of the training calls still running when the run broke: survivors'
        calls end with their peer's loss (the next group's join aborts their collectives). Ray writes an error that is
        never taken into the driver's log whole, when its reference goes ("Unhandled error"): a traceback per
        survivor of what the log already says. One line each instead."""
        interrupted = {ref: self._futures[ref] for ref in self._pending}
        self._pending = []
        if interrupted:
            threading.Thread(
                target=_log_interrupted, args=(interrupted, timeout_s), name="interrupted-calls", daemon=True
            ).start()

    def drain(self, metrics_acknowledged: int) -> list[tuple[RankedWorker, dict[str, list[dict[str, Any]]]]]:
        """Rank 0's metrics, checkpoints and events, and each rank's one memory report ([] when none answer: the
        heartbeats will name who is gone)."""
        sources = [worker for worker in self._group.workers if worker.rank == 0 or worker.rank in self.memory_pending]
        if not sources:
            return []
        try:
            drained = ray.get(
                [worker.actor.drain.remote(metrics_acknowledged if worker.rank == 0 else None) for worker in sources],
                timeout=self._probe[0],
            )
        except (RayActorError, ray.exceptions.GetTimeoutError):
            return []
        for batch in drained:
            self.memory_pending -= {measured["rank"] for measured in batch["memory"]}
        return list(zip(sources, drained))


def _log_interrupted(calls: dict[Any, RankedWorker], timeout_s: float) -> None:
    for ref, worker in calls.items():
        try:
            ray.get(ref, timeout=timeout_s)
        except Exception as error:
            _log_ended(worker, error)


def _log_ended(worker: RankedWorker, error: Exception) -> None:
    """One line for a training call a lost peer interrupted: its error's first line, not its traceback."""
    if isinstance(error, RayTaskError):
        cause = error.cause if error.cause is not None else error
        first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        log.info(
            "rank %d's interrupted training call ended: %s: %s", worker.rank, type(cause).__name__, first_line[:300]
        )
    else:
        log.info("rank %d's interrupted training call ended: %s", worker.rank, type(error).__name__)
