"""The probe after a failed collective, on a fake cluster whose waits advance a fake clock: a worker that stays silent
while its peers answer is lost at the grace after the first answer, not the whole timeout; with no answer the whole
timeout is waited; a worker Ray already knows is dead starts no grace. The same on a real Ray:
tests/cluster/test_probe_on_ray.py."""

from __future__ import annotations

from typing import Any

import pytest
from ray.exceptions import RayActorError

from ringmaster.workers.driver.probe import probe


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        raise AssertionError("the probe waits on its calls, it does not sleep")


class FakeHeartbeats:
    """Heartbeat calls that end at set times: an answer, or a failure (Ray knows the actor dead); None: never."""

    def __init__(self, clock: FakeClock, ends: dict[str, tuple[float, bool] | None]) -> None:
        self.clock = clock
        self.ends = ends  # call -> (when it ends, whether it answers)
        self.waited: list[float] = []

    def wait(self, refs: list[Any], num_returns: int, timeout: float | None) -> tuple[list[Any], list[Any]]:
        assert num_returns == 1 and timeout is not None
        self.waited.append(timeout)
        ending = [(end[0], ref) for ref in refs if (end := self.ends[ref]) is not None]
        first = min(ending, default=None)
        if first is None or first[0] > self.clock.now + timeout:
            self.clock.now += timeout
            return [], refs
        self.clock.now = max(self.clock.now, first[0])
        done = [ref for when, ref in ending if when <= self.clock.now]
        return done, [ref for ref in refs if ref not in done]

    def get(self, ref: Any) -> Any:
        end = self.ends[ref]
        assert end is not None and end[0] <= self.clock.now
        if not end[1]:
            raise RayActorError()
        return 0

    def kill(self, actor: Any) -> None:
        raise AssertionError("the probe kills no one")

    def died_on_a_live_node(self, actor_id: str) -> bool:
        raise AssertionError("the probe asks no cause of death")


def _probe(ends: dict[str, tuple[float, bool] | None], timeout_s: float, grace_s: float) -> tuple[Any, FakeClock]:
    clock = FakeClock()
    beats = {name: name for name in ends}  # each worker is named after its heartbeat call
    return probe(beats, timeout_s, grace_s, FakeHeartbeats(clock, ends), clock), clock


def test_a_silent_worker_is_lost_at_the_grace_after_the_last_peers_answer_on_a_fake_cluster() -> None:
    result, clock = _probe({"a": (0.01, True), "b": (0.2, True), "silent": None}, timeout_s=10.0, grace_s=0.5)
    assert result.lost == ["silent"] and result.ended_by == "grace"
    assert clock.now == pytest.approx(0.01 + 0.5)  # the first answer's grace: a later answer does not extend it


def test_with_no_answer_at_all_the_whole_timeout_is_waited_on_a_fake_cluster() -> None:
    result, clock = _probe({"silent": None}, timeout_s=1.5, grace_s=0.1)
    assert result.lost == ["silent"] and result.ended_by == "timeout"
    assert clock.now == 1.5


def test_a_dead_worker_failing_at_once_starts_no_grace_on_a_fake_cluster() -> None:
    result, clock = _probe({"dead": (0.0, False), "slow": (1.0, True)}, timeout_s=10.0, grace_s=0.2)
    assert result.lost == ["dead"] and result.ended_by == "every call"
    assert clock.now == 1.0  # the slow live worker was waited for past the grace
