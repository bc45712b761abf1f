"""FSDP hybrid sharding through the real job path on a two-node cluster: shards within a node,
replicates across nodes, and trains to the one-process losses."""

from __future__ import annotations

import pytest

from strategy_reference import strategy_spec, train_reference
from harness.ray_cluster import wait_for_state
from harness.simulated_cluster import SimulatedCluster, control_plane_on

pytestmark = pytest.mark.integration

STEPS = 4


def test_fsdp_hybrid_on_two_nodes_matches_single_process(tmp_path):
    cluster = SimulatedCluster(nodes=2, cpus_per_node=2)
    try:
        with control_plane_on(cluster, tmp_path) as server:
            client = server.client()
            job = client.submit(strategy_spec("strategy-hybrid-two-nodes", "fsdp", 4, STEPS, 4, shard="hybrid"))
            done = wait_for_state(client, job["id"], {"SUCCEEDED", "FAILED"}, timeout_s=300)
            assert done["state"] == "SUCCEEDED", done["error"]
            running = next(e for e in client.events(job["id"])["items"] if e["to_state"] == "RUNNING")
            assert "across 2 node(s)" in running["message"]
            losses = [row["loss"] for row in client.metrics(job["id"])["items"] if row["loss"] is not None]
            memory = client.metrics(job["id"])["memory"]
    finally:
        cluster.shutdown()
    assert losses == pytest.approx(train_reference(STEPS).losses, abs=1e-5)
    # Sharded over the 2 ranks of a node, not all 4: each rank holds half the parameters.
    assert {row["dp"] for row in memory} == {4} and len(memory) == 4
    total = memory[0]["parameter_count"] * 4
    assert all(row["measured"]["parameters_bytes"] == pytest.approx(total / 2, rel=0.02) for row in memory)
