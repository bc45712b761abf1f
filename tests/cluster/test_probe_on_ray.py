"""The probe after a failed collective, on a real Ray: a worker that stays silent while its peers answer is lost within
the grace period, not the whole timeout; a live but slow one is not, nor one slower than a peer Ray already knows is
dead. Which deadline ended the wait (the grace, or the whole timeout) is the probe's own record, asserted here rather
than seconds; tests/workers/driver/test_probe.py checks the deadlines exactly on a fake cluster."""

from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import RayActorError

from ringmaster.service.spec import JobSpec
from ringmaster.workers.driver.poll import GroupPoll
from ringmaster.workers.driver.worker_group import RankedWorker, WorkerGroup


@ray.remote(num_cpus=0)
class Peer:
    def __init__(self, answer_after_s: float) -> None:
        self.answer_after_s = answer_after_s

    def heartbeat(self) -> int:
        time.sleep(self.answer_after_s)
        return 0

    def train(self) -> None:
        raise RuntimeError(
            "Connection closed by peer [127.0.0.1]:9366. This is typically caused by a remote process "
            "dying.\nException raised from recvBytes"
        )


def _group(answer_after_s: list[float]) -> WorkerGroup:
    group = WorkerGroup(JobSpec.model_validate({"name": "probe", "model": "mlp"}), collective_timeout_s=60)
    peers = [Peer.remote(delay) for delay in answer_after_s]
    group.workers = [
        RankedWorker(peer, slot=None, node_id=f"node-{rank}", ip="127.0.0.1", pid=0, rank=rank)
        for rank, peer in enumerate(peers)
    ]
    return group


def test_a_silent_worker_is_lost_within_the_grace_after_its_peers_answer(local_ray) -> None:
    group = _group([0.0, 0.0, 30.0])
    ray.get([worker.actor.__ray_ready__.remote() for worker in group.workers])
    lost = group.unresponsive(timeout_s=10.0, grace_s=0.5)
    assert [worker.rank for worker in lost] == [2]
    assert group.last_probe is not None and group.last_probe.ended_by == "grace"  # not the whole timeout


def test_a_slow_live_worker_within_the_grace_is_kept(local_ray) -> None:
    group = _group([0.0, 0.3])
    ray.get([worker.actor.__ray_ready__.remote() for worker in group.workers])
    assert group.unresponsive(timeout_s=10.0, grace_s=2.0) == []
    assert group.last_probe is not None and group.last_probe.ended_by == "every call"


def test_with_no_answer_at_all_the_whole_timeout_is_waited(local_ray) -> None:
    group = _group([30.0])
    ray.get([worker.actor.__ray_ready__.remote() for worker in group.workers])
    lost = group.unresponsive(timeout_s=1.5, grace_s=0.1)
    assert [worker.rank for worker in lost] == [0]
    assert group.last_probe is not None and group.last_probe.ended_by == "timeout"


def test_a_dead_worker_failing_at_once_starts_no_grace_for_the_live_ones(local_ray) -> None:
    """Ray may know a worker is dead before a live peer answers (one busy with a failed collective): that failure
    is no answer, so the live worker still has the whole timeout."""
    group = _group([0.0, 1.0])
    dead, _slow = group.workers
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


def test_a_survivors_call_broken_before_its_peers_loss_is_seen_is_one_line_of_the_log(local_ray, caplog) -> None:
    """The survivor's collective can fail (its peer's socket closed) before Ray reports the peer's death: the poll
    then sees the error first, probes, and finds the peer lost. The survivor's ended call is still one line."""
    group = _group([0.0, 30.0])
    survivor, silent = group.workers
    ray.get([worker.actor.__ray_ready__.remote() for worker in group.workers])
    call = survivor.actor.train.remote()
    ray.wait([call], timeout=30)
    poll = GroupPoll(
        group,
        {call: survivor},
        interval_s=0.1,
        drain_every_s=1000.0,
        heartbeat_interval_s=1000.0,
        heartbeat_timeout_s=1000.0,
        probe_timeout_s=10.0,
        probe_grace_s=0.5,
    )
    with caplog.at_level(logging.INFO, logger="ringmaster.driver"):
        result = poll.poll(metrics_acknowledged=0)
    assert result.lost == [silent] and len(result.errors) == 1
    assert (
        "rank 0's interrupted training call ended: RuntimeError: Connection closed by peer [127.0.0.1]:9366. This "
        "is typically caused by a remote process dying." in caplog.text
    )
    assert "recvBytes" not in caplog.text and "Traceback" not in caplog.text


# -- the same decisions on a fake cluster: its waits advance a fake clock ------------------------------------------
