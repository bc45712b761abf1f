"""The job's worker actors: started on placement-group bundles, ranked node by node, re-formed, probed.

A worker group outlives any one process group: when workers are lost it keeps the survivors,
adds actors on whatever bundles can be placed now, and forms the next generation of the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import TYPE_CHECKING, Any, cast

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ringmaster.service.spec import JobSpec
from ringmaster.workers.driver.bundles import Slot, slot_nodes
from ringmaster.workers.driver.probe import Probe, probe
from ringmaster.workers.driver.ray_facade import LiveRay, SystemClock
from ringmaster.workers.warm_pool import claim_workers
from ringmaster.workers.worker import TrainWorker

if TYPE_CHECKING:
    from ray.actor import ActorClass

_JOIN_GIVE_UP_MARGIN_S = 5.0  # past its rendezvous timeout, a join still waiting has raised and let go of its lock


@dataclass
class RankedWorker:
    actor: Any
    slot: Slot
    node_id: str
    ip: str
    pid: int  # the actor's process
    rank: int = -1
    training_pid: int = 0  # the process that trains (workers/rank_process.py): the one to profile
    actor_id: str = ""
    name: str | None = None  # its Ray actor name: the job's (`<job>-<id>-a<attempt>-w<n>`) or a warm pool worker's
    gpu_ids: tuple[str, ...] = ()  # the GPUs Ray gave it (a script job's workers say; a training worker's need not)

    @classmethod
    def placed(cls, actor: Any, slot: Slot, placement: dict[str, Any]) -> RankedWorker:
        """A started actor, from what its `placement()` answered."""
        return cls(
            actor,
            slot,
            placement["node_id"],
            placement["ip"],
            placement["pid"],
            training_pid=placement["training_pid"],
            actor_id=placement["actor_id"],
            name=placement["name"],
            gpu_ids=tuple(placement.get("gpu_ids", ())),
        )

    def describe(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "pid": self.pid,
            "training_pid": self.training_pid,
            "node_id": self.node_id,
            "actor_id": self.actor_id,
            "name": self.name,
        }


def order_ranks(placements: list[dict[str, Any]]) -> list[int]:
    """Indices of placements in rank order: each node's workers contiguous, nodes ordered by id.

    Contiguous ranks per node are what lets tensor-parallel groups stay inside a node.
    Simulated nodes share one IP, so the node id, not the address, is the key.
    """
    return sorted(range(len(placements)), key=lambda index: (placements[index]["node_id"], index))


class WorkerGroup:
    def __init__(
        self,
        spec: JobSpec,
        collective_timeout_s: float,
        claimant: str | None = None,
        label: str = "worker",
        rendezvous_timeout_s: float | None = None,
        actor_class: Any = TrainWorker,
    ) -> None:
        """`claimant`: the job attempt's Ray submission id, under which it claims warm pool workers (None: never);
        `label`: what the actors it starts are named after (the job and attempt), `<label>-w<n>`;
        `rendezvous_timeout_s`: how long a member waits for the others while the group forms (TrainWorker.join; None:
        the collective timeout); `actor_class`: the workers' Ray actor class (a script job's: ScriptWorker), started
        with TrainWorker's arguments."""
        self.spec = spec
        self._actor_class = actor_class
        self.collective_timeout_s = collective_timeout_s
        self.rendezvous_timeout_s = rendezvous_timeout_s or collective_timeout_s
        self._unfinished_joins: list[Any] = []
        self.claimant = claimant
        self.label = label
        self._started = 0
        self.pooled_started = 0  # workers this group took from the cluster's warm pool, over its whole run
        self.workers: list[RankedWorker] = []
        self.generation = 0
        self._ray, self._clock = LiveRay(), SystemClock()  # what the probe (`unresponsive`) waits through
        self.last_probe: Probe[RankedWorker] | None = None  # the latest `unresponsive`'s: who, and what ended its wait

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def nodes(self) -> list[str]:
        return sorted({worker.node_id for worker in self.workers})

    @property
    def ranks_per_node(self) -> list[int]:
        """Workers on each node in rank order; the device mesh keeps tensor-parallel groups inside these."""
        return [len(list(ranks)) for _, ranks in groupby(self.workers, key=lambda worker: worker.node_id)]

    def start_actors(self, slots: list[Slot]) -> list[tuple[Any, Slot]]:
        """A worker actor for each slot: a warm pool worker on the slot's node where one is idle (CPU workers),
        else a new actor on the bundle. Returns at once (new processes start in the background)."""
        resources = self.spec.workers
        pooled: dict[int, Any] = {}
        if slots and self.claimant and not resources.gpus_per_worker:
            pooled = claim_workers(slot_nodes(slots), self.claimant, resources.cpus_per_worker, self.spec.warm_pool)
            self.pooled_started += len(pooled)
        return [(pooled.get(position) or self._new_actor(slot), slot) for position, slot in enumerate(slots)]

    def _new_actor(self, slot: Slot) -> Any:
        resources = self.spec.workers
        self._started += 1
        actor_class = cast("ActorClass[Any]", self._actor_class)  # ray.remote made it one; mypy keeps the class
        return actor_class.options(
            name=f"{self.label}-w{self._started}",  # the Ray dashboard lists the job's actors by these names
            num_cpus=0 if resources.gpus_per_worker else resources.cpus_per_worker,
            num_gpus=resources.gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(slot.group, placement_group_bundle_index=slot.index),
        ).remote(resources.cpus_per_worker, resources.gpus_per_worker > 0)

    def launch(self, slots: list[Slot], timeout_s: float) -> list[RankedWorker]:
        """Start an actor on each slot; those not running within timeout_s are killed and left out."""
        pending = {actor.placement.remote(): (actor, slot) for actor, slot in self.start_actors(slots)}
        ready, not_ready = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
        started = []
        for ref in ready:
            actor, slot = pending[ref]
            try:
                placement = ray.get(ref)
            except RayActorError:
                continue
            started.append(RankedWorker.placed(actor, slot, placement))
        for ref in not_ready:
            ray.kill(pending[ref][0], no_restart=True)
        return started

    def rank(self, members: list[RankedWorker]) -> None:
        """Make the members the group's next generation, ranked node by node."""
        order = order_ranks([{"node_id": member.node_id} for member in members])
        self.workers = [members[index] for index in order]
        for rank, worker in enumerate(self.workers):
            worker.rank = rank
        self.generation += 1

    def form(self, members: list[RankedWorker]) -> None:
        """Rank members node by node and join them all into a new generation of the process group."""
        self.rank(members)
        if self._unfinished_joins:
            # Members of a formation that failed (a member lost during it) may still wait in its rendezvous, holding
            # their group lock until they give up (the rendezvous timeout): this formation starts once they have.
            ray.wait(
                self._unfinished_joins,
                num_returns=len(self._unfinished_joins),
                timeout=self.rendezvous_timeout_s + _JOIN_GIVE_UP_MARGIN_S,
            )
            self._unfinished_joins = []
        master = self.workers[0]
        port = ray.get(master.actor.rendezvous_port.remote())
        joins = [
            worker.actor.join.remote(
                self.generation,
                worker.rank,
                self.world_size,
                master.ip,
                port,
                self.collective_timeout_s,
                self.rendezvous_timeout_s,
            )
            for worker in self.workers
        ]
        try:
            ray.get(joins)
        except RayActorError:
            self._unfinished_joins = joins
            raise

    def train(
        self,
        job_id: str,
        storage_root: str,
        resume_from_root: str | None = None,
        attempt: int = 1,
        resume_snapshot: dict[str, int] | None = None,
    ) -> dict[Any, RankedWorker]:
        spec_json, layout = self.spec.model_dump_json(), self.ranks_per_node
        return {
            worker.actor.train.remote(
                self.generation, spec_json, job_id, storage_root, layout, resume_from_root, attempt, resume_snapshot
            ): worker
            for worker in self.workers
        }

    def snapshot_inventories(self, job_id: str) -> list[list[dict[str, Any]]]:
        """What each member holds of the job's in-memory snapshots."""
        return ray.get([worker.actor.snapshot_inventory.remote(job_id) for worker in self.workers])

    def unresponsive(
        self, timeout_s: float, grace_s: float, workers: list[RankedWorker] | None = None
    ) -> list[RankedWorker]:
        """Workers (of the group, or those given) that do not answer a heartbeat within timeout_s, nor within grace_s
        of another's answer: dead, or their node frozen (probe.py)."""
        beats = {worker.actor.heartbeat.remote(): worker for worker in (self.workers if workers is None else workers)}
        self.last_probe = probe(beats, timeout_s, grace_s, self._ray, self._clock)
        return self.last_probe.lost

    def remove(self, lost: list[RankedWorker]) -> None:
        for worker in lost:
            ray.kill(worker.actor, no_restart=True)
        self.workers = [worker for worker in self.workers if worker not in lost]

    def request_stop(self) -> None:
        for worker in self.workers:
            worker.actor.request_stop.remote()

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker.actor, no_restart=True)
        self.workers = []
