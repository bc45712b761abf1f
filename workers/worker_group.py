"""Start one worker actor per placement-group bundle, rank them node by node, and form the group."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from service.spec import JobSpec
from workers.worker import TrainWorker


@dataclass
class RankedWorker:
    rank: int
    actor: Any
    node_id: str
    ip: str
    port: int


def order_ranks(placements: list[dict[str, Any]]) -> list[int]:
    """Indices of placements in rank order: each node's workers contiguous, nodes ordered by id.

    Contiguous ranks per node are what later lets tensor-parallel groups stay inside a node.
    Simulated nodes share one IP, so the node id, not the address, is the key.
    """
    return sorted(range(len(placements)), key=lambda index: (placements[index]["node_id"], index))


class WorkerGroup:
    def __init__(self, workers: list[RankedWorker]) -> None:
        self.workers = workers

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def ranks_per_node(self) -> list[int]:
        """Workers on each node in rank order; the device mesh keeps tensor-parallel groups inside these."""
        return [len(list(ranks)) for _, ranks in groupby(self.workers, key=lambda worker: worker.node_id)]

    @classmethod
    def start(cls, spec: JobSpec, group: PlacementGroup, bundle_count: int, collective_timeout_s: float) -> "WorkerGroup":
        resources = spec.workers
        actors = [
            TrainWorker.options(
                num_cpus=0 if resources.gpus_per_worker else resources.cpus_per_worker,
                num_gpus=resources.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
            ).remote(resources.cpus_per_worker, resources.gpus_per_worker > 0)
            for index in range(bundle_count)
        ]
        placements = ray.get([actor.placement.remote() for actor in actors])
        order = order_ranks(placements)
        workers = [
            RankedWorker(rank=rank, actor=actors[index], node_id=placements[index]["node_id"],
                         ip=placements[index]["ip"], port=placements[index]["port"])
            for rank, index in enumerate(order)
        ]
        master = workers[0]
        ray.get([
            worker.actor.join.remote(worker.rank, len(workers), master.ip, master.port, collective_timeout_s)
            for worker in workers
        ])
        return cls(workers)

    def train(self, spec: JobSpec, job_id: str, storage_root: str) -> list[Any]:
        spec_json, layout = spec.model_dump_json(), self.ranks_per_node
        return [worker.actor.train.remote(spec_json, job_id, storage_root, layout) for worker in self.workers]

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker.actor, no_restart=True)
