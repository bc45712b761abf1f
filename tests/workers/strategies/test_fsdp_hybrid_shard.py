"""Hybrid sharding on a two-node layout (4 ranks, 2 per node, as the driver would pass it): FSDP shards
within each node and replicates across nodes, and training matches one process.

The shared Ray cluster is a single node and a process joins one Ray cluster only, so a real two-node
run would need a second cluster with its own control plane in another process; the layout here is the
one the driver derives from Ray node ids (tested in test_parallel_dims.py), fed to the real loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.checkpoints import latest_committed, load_model_weights
from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec
from ringmaster.workers.models import build_bundle
from ringmaster.workers.trainer import TrainContext, run_training
from tests.support.strategy_reference import strategy_spec, train_reference

WORLD_SIZE, RANKS_PER_NODE = 4, (2, 2)
STEPS = 3
SPEC = JobSpec.model_validate(strategy_spec("hybrid", "fsdp", WORLD_SIZE, STEPS, 2, shard="hybrid"))


def _train_hybrid(rank: int, world_size: int, root: str) -> None:
    points, memory = [], []
    context = TrainContext(
        rank,
        world_size,
        torch.device("cpu"),
        "hybrid",
        root,
        sink=CallbackSink(on_metric=points.append, on_memory=memory.append),
        ranks_per_node=RANKS_PER_NODE,
    )
    run_training(SPEC, context)
    Path(root, f"memory{rank}.json").write_text(memory[0].model_dump_json())
    if rank == 0:
        Path(root, "losses.json").write_text(json.dumps([p.loss for p in points if p.loss is not None]))


def test_hybrid_shards_within_a_node_replicates_across_nodes_and_matches_one_process(tmp_path: Path) -> None:
    run_on_ranks(_train_hybrid, WORLD_SIZE, str(tmp_path))
    reference = train_reference(STEPS)

    assert json.loads((tmp_path / "losses.json").read_text()) == pytest.approx(reference.losses, abs=1e-5)
    parameter_count = sum(t.numel() for t in reference.state.values())
    for rank in range(WORLD_SIZE):
        measured = json.loads((tmp_path / f"memory{rank}.json").read_text())
        assert measured["dp"] == WORLD_SIZE
        # Each node's two ranks split the fp32 parameters in half: sharded over 2, not over all 4.
        assert measured["parameters_bytes"] == pytest.approx(4 * parameter_count / 2, rel=0.01), measured
    trained = build_bundle(SPEC).model
    load_model_weights(latest_committed(tmp_path).path, trained)
    for key, expected in reference.state.items():
        torch.testing.assert_close(
            trained.state_dict()[key], expected, rtol=0, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )
