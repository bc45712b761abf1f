"""The cluster's warm pool: idle CPU worker processes with the training stack imported, shared by all jobs.

A new worker costs a process start and `import torch` (plus `torch._dynamo`, which DDP imports): seconds of
CPU before it can join a group, paid again by every job and every replacement. The dispatcher keeps a few
pool workers on each node (`RINGMASTER_WARM_WORKERS_PER_NODE`); a job's driver claims one on the node of
each bundle it was given and starts cold workers only where none is idle.

Resources stay with placement groups: a pool worker holds no CPU of its own (it is created with
`num_cpus=0`); once claimed it trains on the CPUs its job's bundle reserved on that same node. A claimed
worker serves that one job attempt and is killed with it (never reused: a training run leaves process
state behind). Should the driver die without cleaning up, a claimed worker exits once the cluster reports the
driver's Ray job dead; as a backstop the keeper kills claimed workers whose attempt is no longer active.
GPU workers are not pooled: Ray gives GPU ids to the actor that holds the bundle. Pool workers are detached
actors, so they survive a restart of the control plane.

There is a pool per runtime env. The shared pool serves jobs that bring no env of their own; a job with its own
code, requirements or variables (`JobSpec.warm_pool`) claims only workers started in exactly that env, which the
keeper keeps for the few envs most recently submitted: the second job of a project starts warm. Pool workers
import the training stack, never the user's modules (those are imported when a claimed worker trains).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ringmaster.service.spec import SHARED_POOL
from ringmaster.workers.worker import TrainWorker

if TYPE_CHECKING:
    from ray.actor import ActorClass

log = logging.getLogger("ringmaster.warm_pool")

NAME_PREFIX = "warm-worker"
STATUS_TIMEOUT_S = 1.0  # a pool worker answers at once unless its process is still starting
# A pool worker claimed by an attempt no longer active is killed only this long after the keeper first saw it
# so: a driver that just claimed it may be seconds ahead of what the database says.
ORPHAN_GRACE_S = 30.0


def pool_name(pool: str, node_id: str, index: int) -> str:
    return f"{NAME_PREFIX}:{pool}:{node_id}:{index}"


def pools_by_node() -> dict[str, dict[str, list[str]]]:
    """pool -> node -> names of its live workers there, oldest first (likeliest to be warm)."""
    found: dict[str, dict[str, list[tuple[int, str]]]] = defaultdict(lambda: defaultdict(list))
    for name in ray.util.list_named_actors():
        parts = name.split(":")
        if len(parts) == 4 and parts[0] == NAME_PREFIX and parts[3].isdigit():
            found[parts[1]][parts[2]].append((int(parts[3]), name))
    return {
        pool: {node: [name for _, name in sorted(names)] for node, names in nodes.items()}
        for pool, nodes in found.items()
    }


def pool_by_node(pool: str = SHARED_POOL) -> dict[str, list[str]]:
    """Names of one pool's live workers on each node, oldest first."""
    return pools_by_node().get(pool, {})


def pool_statuses(names: list[str]) -> dict[str, tuple[Any, dict[str, Any]]]:
    """name -> (actor, pool_status) for the pool workers that answer within STATUS_TIMEOUT_S."""
    actors: dict[str, Any] = {}
    for name in names:
        try:
            actors[name] = ray.get_actor(name)
        except ValueError:
            continue  # gone since it was listed
    refs = {actor.pool_status.remote(): name for name, actor in actors.items()}
    answered, _ = ray.wait(list(refs), num_returns=len(refs), timeout=STATUS_TIMEOUT_S) if refs else ([], [])
    statuses = {}
    for ref in answered:
        try:
            statuses[refs[ref]] = (actors[refs[ref]], ray.get(ref))
        except RayActorError:
            continue
    return statuses


def pool_workers() -> dict[str, dict[str, Any]]:
    """Every pool worker that answers, on any node: name -> its pool_status."""
    return {
        name: status
        for nodes in pools_by_node().values()
        for names in nodes.values()
        for name, (_, status) in pool_statuses(names).items()
    }


def claim_workers(nodes: list[str | None], claimant: str, cpus: float, pool_key: str = SHARED_POOL) -> dict[int, Any]:
    """Claim an idle, warm worker of pool `pool_key` on each of these nodes: {position in nodes: actor}.

    `claimant` is the job attempt's Ray submission id; positions with no idle pool worker are left out.
    """
    pool = pool_by_node(pool_key)
    wanted = {node for node in nodes if node is not None}
    statuses = pool_statuses([name for node in wanted for name in pool.get(node, [])])
    # Only warm ones: one still importing does so at the lowest priority, so under load it may be slower than a cold
    # start.
    idle = {
        node: [
            statuses[name][0]
            for name in pool.get(node, [])
            if name in statuses and statuses[name][1]["warm"] and statuses[name][1]["claimant"] is None
        ]
        for node in wanted
    }
    owner = ray.get_runtime_context().get_job_id()  # the calling driver's: a claimed worker ends with it
    claimed: dict[int, Any] = {}
    for position, node in enumerate(nodes):
        while node is not None and idle.get(node):
            actor = idle[node].pop(0)
            try:
                if ray.get(actor.claim.remote(claimant, cpus, owner), timeout=STATUS_TIMEOUT_S):
                    claimed[position] = actor
                    break
            except (RayActorError, GetTimeoutError):
                continue  # died, or too slow to trust: start a cold worker instead
    return claimed


def _nodes_with_placement_groups() -> set[str]:
    return {
        node
        for table in placement_group_table().values()
        if table.get("state") == "CREATED"
        for node in table.get("bundles_to_node_id", {}).values()
    }


@dataclass
class TickResult:
    """What one tick decided, by pool worker name: the workers it started and those it killed (outgrown pools and
    workers of ended attempts). Actors start and die asynchronously: this is the decision, not the cluster's state."""

    started: list[str] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)


class WarmPoolKeeper:
    """Keeps `per_node` idle workers of each wanted pool on every live node with CPUs, refilling a node once no
    placement group holds any of it (between jobs); called by the dispatcher every few seconds."""

    def __init__(self, per_node: int, orphan_grace_s: float = ORPHAN_GRACE_S) -> None:
        self.per_node = per_node
        self.orphan_grace_s = orphan_grace_s
        self._orphans_seen: dict[str, float] = {}  # pool worker name -> when first seen claimed by an inactive attempt

    def tick(self, active_claimants: set[str], runtime_envs: dict[str, dict[str, Any]] | None = None) -> TickResult:
        """`runtime_envs`: pool -> the Ray runtime_env its workers start in (URIs only: Ray refuses local paths for an
        actor); pools not named here are emptied of idle workers. Default: the shared pool alone, in this process's
        env. Returns the workers it started and killed."""
        wanted = {SHARED_POOL: {}} if runtime_envs is None else runtime_envs
        pools = pools_by_node()
        statuses = pool_statuses([name for nodes in pools.values() for names in nodes.values() for name in names])
        result = TickResult(killed=self._kill_orphans(statuses, active_claimants))
        busy = _nodes_with_placement_groups()
        cluster_nodes = ray.nodes()  # type: ignore[no-untyped-call]  # Ray leaves it unannotated
        live = [node for node in cluster_nodes if node["Alive"] and node.get("Resources", {}).get("CPU", 0) >= 1]
        for pool in sorted(set(pools) | set(wanted)):
            for node in live:
                names = pools.get(pool, {}).get(node["NodeID"], [])
                # A worker that did not answer counts as idle: most likely its process is still starting.
                idle = [name for name in names if name not in statuses or statuses[name][1]["claimant"] is None]
                target = min(self.per_node, int(node["Resources"]["CPU"])) if pool in wanted else 0
                if node["NodeID"] not in busy and pool in wanted:
                    # Only on a node nothing runs on: starting a worker takes seconds of CPU, taken from training
                    # otherwise.
                    result.started += self._start(pool, wanted[pool], node["NodeID"], names, target - len(idle))
                for name in idle[target:]:  # the pool was made smaller, turned off, or is no longer wanted
                    if name in statuses:
                        ray.kill(statuses[name][0], no_restart=True)
                        result.killed.append(name)
        return result

    def _start(self, pool: str, runtime_env: dict[str, Any], node_id: str, names: list[str], count: int) -> list[str]:
        """Start `count` workers of `pool` on the node; the names of those started."""
        taken = set(names)
        started: list[str] = []
        index = 0
        actor_class = cast("ActorClass[TrainWorker]", TrainWorker)  # ray.remote made it one; mypy keeps the class
        for _ in range(max(0, count)):
            while pool_name(pool, node_id, index) in taken:
                index += 1
            name = pool_name(pool, node_id, index)
            taken.add(name)
            try:
                actor_class.options(
                    name=name,
                    lifetime="detached",
                    num_cpus=0,
                    runtime_env=runtime_env,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                ).remote(0, False, pooled=True)
            except ValueError:
                continue  # another dispatcher started it first
            log.info("warm pool: started %s", name)
            started.append(name)
        return started

    def _kill_orphans(self, statuses: dict[str, tuple[Any, dict[str, Any]]], active_claimants: set[str]) -> list[str]:
        """Kill the claimed workers whose attempt has not been active for orphan_grace_s; their names."""
        now = time.monotonic()
        orphans = {
            name
            for name, (_, status) in statuses.items()
            if status["claimant"] is not None and status["claimant"] not in active_claimants
        }
        self._orphans_seen = {name: self._orphans_seen.get(name, now) for name in orphans}
        killed: list[str] = []
        for name in orphans:
            if now - self._orphans_seen[name] >= self.orphan_grace_s:
                log.warning("warm pool: %s outlived attempt %s; killing it", name, statuses[name][1]["claimant"])
                ray.kill(statuses[name][0], no_restart=True)
                del self._orphans_seen[name]
                killed.append(name)
        return killed
