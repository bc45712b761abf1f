"""The one owner of the parallel dimensions: it checks them against the world and the node layout
and builds the single DeviceMesh every strategy takes its sub-meshes from, by name.

Placement rule (ranks arrive ordered node by node): tp is the innermost mesh dimension, so a
tensor-parallel group is contiguous ranks on one node; pp comes next and may span nodes; data
parallelism is outermost. Hybrid sharding splits dp into (dp_replicate across nodes, dp_shard
within a node).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ringmaster.service.catalogue import STRATEGIES
from ringmaster.service.spec import JobSpec


class PlacementError(ValueError):
    """The parallel dimensions cannot be laid out on this world and node layout."""


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    pp: int
    tp: int
    ranks_per_node: tuple[int, ...]

    def __post_init__(self) -> None:
        world_size = sum(self.ranks_per_node)
        product = self.dp_replicate * self.dp_shard * self.pp * self.tp
        if product != world_size:
            raise PlacementError(
                f"dp_replicate × dp_shard × pp × tp = {self.dp_replicate} × {self.dp_shard} × {self.pp} × {self.tp} = "
                f"{product} must equal the world size {world_size}"
            )
        if any(count % self.tp for count in self.ranks_per_node):
            common = math.gcd(*self.ranks_per_node)
            fitting = [tp for tp in range(1, common + 1) if common % tp == 0]
            raise PlacementError(
                f"parallel.tp ({self.tp}) must divide the workers on every node so that each tensor-parallel group "
                f"stays inside one node; the job's nodes hold {list(self.ranks_per_node)} workers, so tp can be one of "
                f"{fitting}"
            )
        if self.hybrid:
            self._check_hybrid_layout()

    @classmethod
    def from_spec(cls, spec: JobSpec, world_size: int, ranks_per_node: tuple[int, ...] | None = None) -> ParallelDims:
        """Dimensions for ``spec`` on ``world_size`` ranks; ``ranks_per_node`` None means one node holds them all."""
        layout = tuple(ranks_per_node) if ranks_per_node else (world_size,)
        if sum(layout) != world_size:
            raise PlacementError(
                f"the node layout {list(layout)} holds {sum(layout)} ranks, not the world size {world_size}"
            )
        tp, pp = spec.parallel.tp, spec.parallel.pp
        if world_size % (tp * pp):
            raise PlacementError(f"parallel.tp × parallel.pp ({tp} × {pp}) must divide the world size {world_size}")
        dp = world_size // (tp * pp)
        entry = STRATEGIES.get(spec.strategy)  # None: auto, which the planner resolves before training
        if entry is not None and entry.shards and spec.parallel.shard == "hybrid":
            if len(layout) < 2:
                raise PlacementError(
                    f"parallel.shard 'hybrid' shards within a node and replicates across nodes, but all {world_size} "
                    "workers are on one node; use shard 'zero3' (or 'zero2') there, or place the job on two or more "
                    "nodes"
                )
            replicas = len(layout)
            if dp % replicas:
                raise PlacementError(
                    f"parallel.shard 'hybrid': {len(layout)} nodes do not divide the data-parallel size {dp}"
                )
            return cls(dp_replicate=replicas, dp_shard=dp // replicas, pp=pp, tp=tp, ranks_per_node=layout)
        return cls(dp_replicate=1, dp_shard=dp, pp=pp, tp=tp, ranks_per_node=layout)

    def _check_hybrid_layout(self) -> None:
        """Each node must hold exactly one dp_shard × pp × tp block, so shards never leave a node."""
        per_replica = self.dp_shard * self.pp * self.tp
        if len(set(self.ranks_per_node)) != 1 or self.ranks_per_node[0] != per_replica:
            raise PlacementError(
                f"parallel.shard 'hybrid' needs the same number of workers on every node, each node holding one "
                f"replica of dp_shard × pp × tp = {per_replica} ranks; the job's nodes hold {list(self.ranks_per_node)}"
            )

    @property
    def hybrid(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the model (what the batch is split over)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return sum(self.ranks_per_node)

    @property
    def dp_mesh_names(self) -> tuple[str, ...]:
        """The sub-mesh data parallelism runs over: 2-D (replicate, shard) for hybrid, else 1-D."""
        return ("dp_replicate", "dp_shard") if self.hybrid else ("dp",)

    @property
    def mesh_shape(self) -> tuple[tuple[str, int], ...]:
        """Named dimensions, outermost first: dp (or dp_replicate, dp_shard), then pp, then tp innermost. pp and tp
        only where larger than 1: a dimension of size 1 gives each rank a process group of its own, which nothing
        uses, and each gloo group keeps a thread that wakes every 10 ms; on busy cores those wakeups preempt training
        (three idle groups slowed bench/bare_torchrun.py's hf-gpt2 loop on two CPU ranks by about 5% here)."""
        dp_dims = (
            (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard)) if self.hybrid else (("dp", self.dp),)
        )
        return (*dp_dims, *((name, size) for name, size in (("pp", self.pp), ("tp", self.tp)) if size > 1))

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Collective: the world's one DeviceMesh (without pp and tp where they are 1: see mesh_shape)."""
        names, sizes = zip(*self.mesh_shape)
        return init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))

    @staticmethod
    def local_rank(mesh: DeviceMesh, name: str) -> int:
        """This rank's index along dimension `name`: 0 along one of size 1, which the mesh leaves out."""
        return mesh.get_local_rank(name) if name in (mesh.mesh_dim_names or ()) else 0

    def dp_rank(self, mesh: DeviceMesh) -> int:
        """This rank's data-parallel index in [0, dp): which shard of every batch it trains on."""
        if self.hybrid:
            return mesh.get_local_rank("dp_replicate") * self.dp_shard + mesh.get_local_rank("dp_shard")
        return mesh.get_local_rank("dp")
