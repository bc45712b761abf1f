"""The placement rule: one mesh with tp innermost, pp next and dp outermost, so a tensor-parallel group
is contiguous ranks on one node; hybrid shards within a node and replicates across nodes; a layout that
breaks the rule is rejected with a message saying what would fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from harness.process_group import run_on_ranks
from ringmaster.service.spec import JobSpec
from ringmaster.workers.driver.worker_group import RankedWorker, WorkerGroup
from ringmaster.workers.parallel_dims import ParallelDims, PlacementError

# (strategy, parallel, node layout) for 4 ranks
LAYOUTS = {
    "3d dp2 tp2": ("3d", {"tp": 2}, (4,)),
    "3d pp2 tp2": ("3d", {"tp": 2, "pp": 2}, (2, 2)),
    "hybrid 2 nodes": ("fsdp", {"shard": "hybrid"}, (2, 2)),
    "ddp 4": ("ddp", {}, (4,)),
    "pipeline pp2": ("pipeline", {"pp": 2, "microbatches": 4}, (2, 2)),
}


def _spec(strategy: str, workers: int, **parallel) -> JobSpec:
    return JobSpec(
        name="dims",
        model="tiny-gpt",
        strategy=strategy,
        parallel=parallel,
        workers={"min": workers, "max": workers},
        train={"global_batch_size": 96, "micro_batch_size": 4},
    )


def _gloo_loops() -> int:
    """This process's gloo event-loop threads: one per gloo process group it is a member of."""
    tasks = Path("/proc/self/task")
    return sum((task / "comm").read_text().strip() == "gloo_tcp_loop" for task in tasks.iterdir())


def _record_mesh_groups(rank: int, world_size: int, root: str) -> None:
    """Runs on each rank: the ranks of every named sub-mesh this rank belongs to, per layout."""
    groups = {}
    for name, (strategy, parallel, layout) in LAYOUTS.items():
        dims = ParallelDims.from_spec(_spec(strategy, world_size, **parallel), world_size, layout)
        loops_before = _gloo_loops()
        mesh = dims.build_mesh("cpu")
        groups[name] = {dim: mesh[dim].mesh.tolist() for dim in mesh.mesh_dim_names}
        groups[name]["new gloo loops"] = _gloo_loops() - loops_before
        groups[name]["local ranks"] = [dims.local_rank(mesh, dim) for dim in ("pp", "tp")]
    all_groups = [None] * world_size
    dist.all_gather_object(all_groups, groups)
    if rank == 0:
        Path(root, "groups.json").write_text(json.dumps(all_groups))


def test_mesh_puts_tp_innermost_pp_next_dp_outermost_and_hybrid_shards_within_a_node(tmp_path: Path) -> None:
    run_on_ranks(_record_mesh_groups, 4, str(tmp_path))
    by_rank = json.loads((tmp_path / "groups.json").read_text())

    def groups(layout: str, dim: str) -> list[list[int]]:
        return sorted({tuple(ranks[layout][dim]) for ranks in by_rank})

    assert groups("3d dp2 tp2", "tp") == [(0, 1), (2, 3)]
    assert groups("3d dp2 tp2", "dp") == [(0, 2), (1, 3)]
    assert groups("3d pp2 tp2", "tp") == [(0, 1), (2, 3)], "a tp group is one node's contiguous ranks"
    assert groups("3d pp2 tp2", "pp") == [(0, 2), (1, 3)], "pipeline stages span the nodes"
    assert groups("hybrid 2 nodes", "dp_shard") == [(0, 1), (2, 3)], "shards stay inside a node"
    assert groups("hybrid 2 nodes", "dp_replicate") == [(0, 2), (1, 3)], "replicas across nodes"


def test_the_mesh_leaves_out_pp_and_tp_of_size_1_so_no_rank_keeps_idle_process_groups(tmp_path: Path) -> None:
    """Each gloo group keeps a thread that wakes every 10 ms; a size-1 dimension would give every rank one more."""
    run_on_ranks(_record_mesh_groups, 4, str(tmp_path))
    by_rank = json.loads((tmp_path / "groups.json").read_text())
    for rank, layouts in enumerate(by_rank):
        assert sorted(layouts["ddp 4"]) == ["dp", "local ranks", "new gloo loops"], layouts["ddp 4"]
        assert layouts["ddp 4"]["new gloo loops"] == 0, "dp spans the world: the default group serves it"
        assert layouts["ddp 4"]["local ranks"] == [0, 0]
        assert "tp" not in layouts["pipeline pp2"] and layouts["pipeline pp2"]["local ranks"] == [rank % 2, 0]
        assert layouts["3d dp2 tp2"]["local ranks"] == [0, rank % 2]


def test_tp_that_does_not_divide_the_workers_per_node_is_rejected_with_what_fits() -> None:
    with pytest.raises(
        PlacementError,
        match=r"parallel\.tp \(2\) must divide the workers on every node .* "
        r"hold \[3, 1\] workers, so tp can be one of \[1\]",
    ):
        ParallelDims.from_spec(_spec("tensor", 4, tp=2), 4, (3, 1))
    with pytest.raises(PlacementError, match=r"hold \[4, 2\] workers, so tp can be one of \[1, 2\]"):
        ParallelDims.from_spec(_spec("tensor", 6, tp=3), 6, (4, 2))
    assert ParallelDims.from_spec(_spec("tensor", 6, tp=2), 6, (4, 2)).dp == 3


def test_dimensions_must_multiply_to_the_world_size() -> None:
    with pytest.raises(PlacementError, match=r"1 × 3 × 1 × 2 = 6 must equal the world size 4"):
        ParallelDims(dp_replicate=1, dp_shard=3, pp=1, tp=2, ranks_per_node=(4,))


def test_hybrid_never_falls_back_on_one_node_or_uneven_nodes() -> None:
    with pytest.raises(PlacementError, match="all 4 workers are on one node; use shard 'zero3'"):
        ParallelDims.from_spec(_spec("fsdp", 4, shard="hybrid"), 4, None)
    with pytest.raises(PlacementError, match=r"same number of workers on every node.*hold \[3, 1\]"):
        ParallelDims.from_spec(_spec("fsdp", 4, shard="hybrid"), 4, (3, 1))
    dims = ParallelDims.from_spec(_spec("fsdp", 6, shard="hybrid"), 6, (3, 3))
    assert (dims.dp_replicate, dims.dp_shard, dims.dp_mesh_names) == (2, 3, ("dp_replicate", "dp_shard"))


def test_worker_group_passes_the_node_layout_of_its_ranks() -> None:
    group = WorkerGroup(_spec("ddp", 4), collective_timeout_s=60)
    group.workers = [
        RankedWorker(None, None, node, "127.0.0.1", 0, rank)
        for rank, node in enumerate(["node-a", "node-a", "node-a", "node-b"])
    ]
    assert group.ranks_per_node == [3, 1]
