"""The cluster's warm worker pool on a real (local) Ray: the keeper fills each node, jobs claim only warm idle workers,
each worker serves one claimant, and workers of attempts that ended are reaped.

Each scenario runs in a process of its own with its own local Ray: this test process may already be connected to the
session's cluster, whose dispatcher keeps a pool of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from ringmaster.service.naming import NAMESPACE
from ringmaster.service.spec import SHARED_POOL
from ringmaster.workers.warm_pool import WarmPoolKeeper, claim_workers, pool_by_node, pool_name, pool_statuses

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "scenario",
    [
        "fills_the_node_and_each_warm_worker_serves_one_claimant",
        "claim_takes_only_workers_on_the_slots_nodes",
        "a_node_holding_a_placement_group_is_not_refilled",
        "a_claimed_worker_ends_with_its_driver",
        "each_runtime_env_has_a_pool_of_its_own",
    ],
)
def test_warm_pool(scenario: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tests.cluster.test_warm_pool", scenario],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, f"{scenario} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert f"{scenario}: ok" in result.stdout


def _pool(node: str, pool: str = SHARED_POOL) -> dict[str, dict]:
    return {name: status for name, (_, status) in pool_statuses(pool_by_node(pool).get(node, [])).items()}


def _wait_for(condition, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:.0f}s"
        time.sleep(0.25)
    return result


def fills_the_node_and_each_warm_worker_serves_one_claimant(node: str) -> None:
    keeper = WarmPoolKeeper(per_node=2, orphan_grace_s=0.0)
    keeper.tick(active_claimants=set())
    _wait_for(
        lambda: len(_pool(node)) == 2 and all(status["warm"] for status in _pool(node).values()),
        "two warm pool workers",
    )
    keeper.tick(active_claimants=set())
    assert len(_pool(node)) == 2, "a full pool was topped up again"

    claimed = claim_workers([node, node, node], "attempt-a", cpus=1)
    assert sorted(claimed) == [0, 1], "two idle workers, so the third position must start cold"
    assert not any(ray.get([actor.claim.remote("attempt-b", 1, "ff") for actor in claimed.values()])), "claimed twice"
    assert claim_workers([node], "attempt-b", cpus=1) == {}
    assert sorted(status["claimant"] for status in _pool(node).values()) == ["attempt-a", "attempt-a"]

    # The claimed two are busy: the keeper starts two idle ones beside them and leaves a live attempt's workers alone.
    keeper.tick(active_claimants={"attempt-a"})
    _wait_for(lambda: len(_pool(node)) == 4, "the pool topped up beside its claimed workers")
    assert sorted(str(status["claimant"]) for status in _pool(node).values()) == [
        "None",
        "None",
        "attempt-a",
        "attempt-a",
    ]

    # attempt-a ended without its driver killing them: they are reaped, the idle ones stay.
    keeper.tick(active_claimants=set())
    _wait_for(lambda: len(_pool(node)) == 2, "the ended attempt's workers reaped")
    assert all(status["claimant"] is None for status in _pool(node).values())

    WarmPoolKeeper(per_node=0).tick(active_claimants=set())
    _wait_for(lambda: not pool_by_node().get(node), "the pool emptied when turned off", timeout_s=30)


def claim_takes_only_workers_on_the_slots_nodes(node: str) -> None:
    keeper = WarmPoolKeeper(per_node=1)
    keeper.tick(active_claimants=set())
    _wait_for(
        lambda: len(_pool(node)) == 1 and all(status["warm"] for status in _pool(node).values()), "a warm pool worker"
    )
    assert claim_workers([None, "0" * 56], "attempt-c", cpus=1) == {}, "claimed for an unplaced slot or another node"
    claimed = claim_workers([None, node], "attempt-c", cpus=1)
    assert list(claimed) == [1]
    ray.kill(claimed[1], no_restart=True)
    WarmPoolKeeper(per_node=0).tick(active_claimants=set())


def a_node_holding_a_placement_group_is_not_refilled(node: str) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    busy = placement_group([{"CPU": 1}])
    ray.get(busy.ready())
    keeper = WarmPoolKeeper(per_node=1)
    assert keeper.tick(active_claimants=set()).started == [], "a worker started on a node that is training"
    assert not pool_by_node().get(node), "a worker started on a node that is training"
    remove_placement_group(busy)
    assert keeper.tick(active_claimants=set()).started == [pool_name(SHARED_POOL, node, 0)], "the idle node not filled"
    _wait_for(lambda: pool_by_node().get(node), "a worker started once the node is idle", timeout_s=30)
    WarmPoolKeeper(per_node=0).tick(active_claimants=set())


_CLAIMING_DRIVER = """
import sys, time, ray
from ringmaster.workers.warm_pool import claim_workers
ray.init(address=sys.argv[1], namespace=sys.argv[2], logging_level="ERROR")
print("claimed", sorted(claim_workers([sys.argv[3]], "attempt-d", cpus=1)), flush=True)
time.sleep(600)
"""


def a_claimed_worker_ends_with_its_driver(node: str) -> None:
    """A pool worker is detached, so Ray would keep it after its driver dies: it must end itself, or it would go on
    training the attempt beside the one that replaces it."""
    keeper = WarmPoolKeeper(per_node=2)
    keeper.tick(active_claimants=set())
    _wait_for(
        lambda: len(_pool(node)) == 2 and all(status["warm"] for status in _pool(node).values()),
        "two warm pool workers",
    )
    mine = claim_workers([node], "attempt-e", cpus=1)  # this process is the claimant's live driver
    driver = subprocess.Popen(
        [sys.executable, "-c", _CLAIMING_DRIVER, ray.get_runtime_context().gcs_address, NAMESPACE, node],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert driver.stdout.readline().strip() == "claimed [0]"
        assert sorted(status["claimant"] for status in _pool(node).values()) == ["attempt-d", "attempt-e"]
        # No heartbeats from either driver: after the silence each worker asks the cluster whether its driver lives;
        # silence alone is no reason to end. Both asked twice, found their drivers alive, and are still there.
        _wait_for(
            lambda: [status["owner_checks"] >= 2 for status in _pool(node).values()] == [True, True],
            "both claimed workers asking twice about their live drivers",
            timeout_s=30,
        )
        assert len(_pool(node)) == 2, "a claimed worker ended while its driver lived"
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    killed = time.monotonic()
    _wait_for(
        lambda: [status["claimant"] for status in _pool(node).values()] == ["attempt-e"],
        "the dead driver's pool worker gone",
        timeout_s=15,
    )
    print(f"the dead driver's worker ended {time.monotonic() - killed:.1f}s after it", flush=True)
    ray.kill(mine[0], no_restart=True)
    WarmPoolKeeper(per_node=0).tick(active_claimants=set())


def each_runtime_env_has_a_pool_of_its_own(node: str) -> None:
    """A job with its own runtime env claims only workers started in that env; a pool no longer wanted empties."""
    keeper = WarmPoolKeeper(per_node=1)
    envs = {SHARED_POOL: {}, "env-project": {"env_vars": {"PROJECT_SETTING": "project"}}}
    keeper.tick(active_claimants=set(), runtime_envs=envs)
    _wait_for(
        lambda: all(
            len(_pool(node, pool)) == 1 and all(status["warm"] for status in _pool(node, pool).values())
            for pool in envs
        ),
        "a warm worker in each pool",
    )
    assert claim_workers([node], "attempt-f", cpus=1, pool_key="env-other") == {}, "claimed from another env's pool"
    [shared] = claim_workers([node], "attempt-f", cpus=1).values()
    [own] = claim_workers([node], "attempt-g", cpus=1, pool_key="env-project").values()
    setting = lambda actor: ray.get(actor.__ray_call__.remote(lambda _: os.environ.get("PROJECT_SETTING")))  # noqa: E731
    assert (setting(shared), setting(own)) == (None, "project"), "each pool's workers run in their own env"

    # Only the shared pool is wanted now: the project's pool starts nothing more; its claimed worker stays with its
    # attempt.
    tick = keeper.tick(active_claimants={"attempt-f", "attempt-g"}, runtime_envs={SHARED_POOL: {}})
    project = pool_name("env-project", node, 0)
    assert [name for name in tick.started if name.split(":")[1] == "env-project"] == [], "an unwanted pool grew"
    assert tick.killed == [], "a claimed worker was killed while its attempt is active"
    assert [(name, status["claimant"], status["warm"]) for name, status in _pool(node, "env-project").items()] == [
        (project, "attempt-g", True)
    ]
    for actor in (shared, own):
        ray.kill(actor, no_restart=True)
    WarmPoolKeeper(per_node=0).tick(active_claimants=set())


if __name__ == "__main__":
    name = sys.argv[1]
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", namespace=NAMESPACE)
    try:
        globals()[name](ray.get_runtime_context().get_node_id())
    finally:
        ray.shutdown()
    print(f"{name}: ok", flush=True)
