"""The probe after a failed collective: a worker that stays silent while its peers answer is lost within the grace
period, not the whole timeout; a live but slow one is not, nor one slower than a peer Ray already knows is dead."""

from __future__ import annotations

import time

import ray
from ray.exceptions import RayActorError

from ringmaster.service.spec import JobSpec
from ringmaster.workers.driver.worker_group import RankedWorker, WorkerGroup


@ray.remote(num_cpus=0)
class Peer:
    def __init__(self, answer_after_s: float) -> None:
        self.answer_after_s = answer_after_s

    def heartbeat(self) -> int:
        time.sleep(self.answer_after_s)
        return 0


def _group(answer_after_s: list[float]) -> WorkerGroup:
    group = WorkerGroup(JobSpec.model_validate({"name": "probe", "model": "mlp"}), collective_timeout_s=60)
    peers = [Peer.remote(delay) for delay in answer_after_s]
    group.workers = [RankedWorker(peer, slot=None, node_id=f"node-{rank}", ip="127.0.0.1", pid=0, rank=rank)
                     for rank, peer in enumerate(peers)]
    return group


def test_a_silent_worker_is_lost_within_the_grace_after_its_peers_answer(local_ray) -> None:
    group = _group([0.0, 0.0, 30.0])
    ray.get([worker.actor.__ray_ready__.remote() for worker in group.workers])
    started = time.monotonic()
    lost = group.unresponsive(timeout_s=10.0, grace_s=0.5)
    took = time.monotonic() - started
    assert [worker.rank for worker in lost] == [2]
    assert took < 3.0, f"the probe waited {took:.1f}s for a worker whose peers answered at once"


def test_a_slow_live_worker_within_the_grace_is_kept(local_ray) -> None:
    group = _group([0.0, 0.3])
    ray.get([worker.actor.__ray_ready__.remote() for worker in group.workers])
    assert group.unresponsive(timeout_s=10.0, grace_s=2.0) == []


def test_with_no_answer_at_all_the_whole_timeout_is_waited(local_ray) -> None:
    group = _group([30.0])
    ray.get([worker.actor.__ray_ready__.remote() for worker in group.workers])
    started = time.monotonic()
    lost = group.unresponsive(timeout_s=1.5, grace_s=0.1)
    assert [worker.rank for worker in lost] == [0] and time.monotonic() - started >= 1.5


def test_a_dead_worker_failing_at_once_starts_no_grace_for_the_live_ones(local_ray) -> None:
    """Ray may know a worker is dead before a live peer answers (one busy with a failed collective): that failure
    is no answer, so the live worker still has the whole timeout."""
    group = _group([0.0, 1.0])
    dead, slow = group.workers
    ray.get([worker.actor.__ray_ready__.remote() for worker in group.workers])
    ray.kill(dead.actor, no_restart=True)
    _wait_until_ray_knows_it_dead(dead.actor)
    lost = group.unresponsive(timeout_s=10.0, grace_s=0.2)
    assert lost == [dead]


def _wait_until_ray_knows_it_dead(actor, timeout_s: float = 30.0) -> None:
    """ray.kill returns before the actor is gone: a call made at once can still be answered by it (CI saw that
    answer start the grace for the live peer)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"Ray still reports the killed actor alive after {timeout_s}s")
