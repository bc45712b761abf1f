"""A node killed mid-run, for every parallel layout: the group re-forms with a replacement and continues from the
state its members hold in memory (checkpoint.in_memory), on a simulated multi-node cluster through the REST API.

For each layout: the job SUCCEEDS; at most one optimizer step is computed twice, counted from each rank's own
step record (train.record_sample_ids); the restore read no storage (the storage layer counts every read, and the
restore event reports the sum over ranks); the per-step losses equal one process training on the same global
batches (tests/support/strategy_reference.py), step for step, within 1e-6; and, as for an uninterrupted run
(tests/cluster/test_strategies_on_ray.py, which leaves these layouts to this module), the final checkpoint holds the one
process's weights and every rank reports its state memory (hybrid's: half the parameters each, sharded within a
node and replicated across the two). ddp's node loss with a replacement is
tests/cluster/test_elastic.py's (against an uninterrupted run of the job itself).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from ray.util.state import list_actors

from harness.checkpoints import load_model_weights
from harness.local_control_plane import wait_for_state
from harness.simulated_cluster import newest_recorded_step, served_cluster, wait_for_recorded_step
from ringmaster.service.spec import JobSpec
from ringmaster.workers.data.audit import read_effective_samples, read_steps_by_generation
from ringmaster.workers.models import build_bundle
from tests.support.strategy_reference import ReferenceRun, strategy_spec, train_reference

pytestmark = pytest.mark.integration

# These tiny models' steps take tens of milliseconds: the kill, once a rank has recorded KILL_AFTER_STEP, must land
# before the job's last step, after finding the job's nodes (a query of Ray's state API); _assert_killed_mid_run
# checks that it did.
STEPS = 20
KILL_AFTER_STEP = 4
CPUS_PER_NODE = 2
TOLERANCE = 1e-6

# name: (strategy, workers, cpus per worker, micro batch, parallel). Two nodes of two CPUs: one rank per node
# where a worker takes both, else two; a layout's node-local group (hybrid's shard group, tensor's tp) is a node.
CASES = {
    "zero1": ("zero1", 2, 2, 4, {}),
    "fsdp-zero3": ("fsdp", 2, 2, 4, {"shard": "zero3"}),
    "fsdp-hybrid": ("fsdp", 4, 1, 2, {"shard": "hybrid"}),
    "pipeline-1f1b": ("pipeline", 2, 2, 2, {"pp": 2, "microbatches": 4, "schedule": "1f1b"}),
    "tensor": ("tensor", 4, 1, 4, {"tp": 2}),
    "3d-fsdp-tp-2x2": ("3d", 4, 1, 4, {"tp": 2, "shard": "zero3"}),
}


def _spec(name: str) -> dict:
    strategy, workers, cpus, micro_batch, parallel = CASES[name]
    spec = strategy_spec(f"memory-{name}", strategy, workers, STEPS, micro_batch, **parallel)
    return {
        **spec,
        "workers": {**spec["workers"], "cpus_per_worker": cpus},
        "train": {**spec["train"], "record_sample_ids": True},
        # a durable checkpoint exists (the fallback), but recovery must not read it
        "checkpoint": {"every_steps": 4, "keep": 2},
        "max_failures": 2,
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with served_cluster(3, tmp_path_factory.mktemp("memory-recovery"), cpus_per_node=CPUS_PER_NODE) as simulated:
        yield simulated


@pytest.fixture(scope="module")
def reference() -> ReferenceRun:
    return train_reference(STEPS)


def _steps_computed_twice(storage: Path, job_id: str, total_steps: int = STEPS) -> tuple[int, int]:
    """(steps that more than one formation of the group computed, formations), from every rank's own record."""
    steps_by_generation = read_steps_by_generation(storage / job_id)
    computed = Counter(step for steps in steps_by_generation.values() for step in steps)
    assert set(computed) == set(range(1, total_steps + 1)), "a step was never computed"
    return sum(1 for times in computed.values() if times > 1), len(steps_by_generation)


@pytest.mark.parametrize("name", list(CASES))
def test_a_killed_node_is_replaced_and_the_run_continues_from_memory(name, cluster, reference):
    cluster.ensure_nodes(3)  # the job's two, and the replacement, idle from the start
    client = cluster.client
    job_id = client.submit(_spec(name))["id"]
    wait_for_recorded_step(cluster.storage / job_id, KILL_AFTER_STEP)
    cluster.kill_node(_worker_nodes(cluster)[-1])
    _assert_killed_mid_run(cluster, job_id)
    done = wait_for_state(client, job_id, {"SUCCEEDED", "FAILED"}, timeout_s=240)
    assert done["state"] == "SUCCEEDED", done["error"]

    events = client.events(job_id)["items"]
    regroups = [e["data"] for e in events if e["data"] and "resumed_from" in e["data"]]
    assert [data["resumed_from"] for data in regroups] == ["memory"], regroups
    restores = [e["data"] for e in events if e["data"] and e["data"].get("source") == "memory"]
    assert len(restores) == 1 and restores[0]["storage_reads"] == 0 and restores[0]["bytes_moved"] > 0, restores
    # Step KILL_AFTER_STEP was recorded before the kill, so the snapshot of the step before it was complete.
    assert restores[0]["restored_step"] >= KILL_AFTER_STEP - 1, restores

    # Snapshots after the first reuse its layout (a full DCP save per step would be many times slower).
    costs = [
        cost
        for e in events
        if e["data"] and "snapshot_host_memory" in e["data"]
        for cost in e["data"]["snapshot_host_memory"]
    ]
    assert costs and all(cost["full_saves"] == 1 for cost in costs), costs

    twice, formations = _steps_computed_twice(cluster.storage, job_id)
    assert formations == 2 and twice <= 1, f"{twice} steps computed twice over {formations} formations"

    metrics = client.metrics(job_id)
    rows = [row for row in metrics["items"] if row["loss"] is not None]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert [row["loss"] for row in rows] == pytest.approx(reference.losses, abs=TOLERANCE)
    assert math.isfinite(metrics["items"][-1]["val_loss"])

    final = Path(client.checkpoints(job_id)["items"][-1]["uri"])
    trained = build_bundle(JobSpec.model_validate(_spec(name))).model
    load_model_weights(final, trained)  # unsplit FQNs: a plain module loads any layout's shards
    for key, expected in reference.state.items():
        torch.testing.assert_close(
            trained.state_dict()[key], expected, rtol=0, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )
    workers = CASES[name][1]
    memory = [entry for entry in metrics["memory"] if entry["attempt"] == 1]
    assert sorted(entry["rank"] for entry in memory) == list(range(workers)), "every rank reports its memory once"
    parameter_count = sum(t.numel() for t in reference.state.values())
    assert all(entry["parameter_count"] == parameter_count and entry["measured"]["total_bytes"] > 0 for entry in memory)
    if name in ("fsdp-zero3", "pipeline-1f1b"):  # disjoint pieces of the parameters: their fp32 shards add up
        assert sum(entry["measured"]["parameters_bytes"] for entry in memory) == 4 * parameter_count
    if name == "fsdp-hybrid":
        # Across both nodes, sharded over a node's 2 ranks and replicated across nodes: each rank holds half.
        running = next(e for e in events if e["to_state"] == "RUNNING")
        assert "across 2 node(s)" in running["message"], running["message"]
        assert all(
            entry["measured"]["parameters_bytes"] == pytest.approx(4 * parameter_count / 2, rel=0.02)
            for entry in memory
        )


SHRINK_BATCH = 24  # whole micro-batches of 2 at 4, 3 and 1 workers
# Three and four ranks of two CPUs each on this machine's cores take about a second a step: these jobs run half the
# steps, still ending well after their kill (which _assert_killed_mid_run checks).
SHARDED_STEPS = 16


@pytest.fixture(scope="module")
def reference_24() -> ReferenceRun:
    return train_reference(SHARDED_STEPS, global_batch=SHRINK_BATCH)


def _sharded_spec(name: str, workers: int, minimum: int) -> dict:
    spec = strategy_spec(name, "fsdp", workers, SHARDED_STEPS, 2, shard="zero3", global_batch=SHRINK_BATCH)
    return {
        **spec,
        "workers": {"min": minimum, "max": workers, "cpus_per_worker": CPUS_PER_NODE},
        "train": {**spec["train"], "record_sample_ids": True},
        "checkpoint": {"every_steps": 4, "keep": 2},
        "max_failures": 2,
    }


def _assert_killed_mid_run(cluster, job_id: str, steps: int = STEPS) -> int:
    """The job had not ended when its node(s) went (a survivor completes no step without them); returns the newest
    step recorded."""
    newest = newest_recorded_step(cluster.storage / job_id)
    assert newest < steps, (
        f"job {job_id} had recorded its last step (of {steps}) before the kill: the test proves nothing"
    )
    return newest


def _worker_nodes(cluster) -> list:
    actors = list_actors(
        address=cluster.dashboard_url, filters=[("class_name", "=", "TrainWorker"), ("state", "=", "ALIVE")]
    )
    return [cluster.node_by_id(node_id) for node_id in sorted({actor["node_id"] for actor in actors})]


def test_a_sharded_group_shrinks_from_four_to_three_from_memory(cluster, reference_24):
    """fsdp zero3 on four nodes, one lost and none to replace it: the three survivors reshard the four ranks' state
    from memory and keep the global batch (4 micro-steps instead of 3)."""
    cluster.ensure_nodes(4)  # every node taken by the job: nothing left to replace the lost one
    client = cluster.client
    job_id = client.submit(_sharded_spec("memory-shrink-4-to-3", 4, 1))["id"]
    wait_for_recorded_step(cluster.storage / job_id, KILL_AFTER_STEP)
    cluster.kill_node(_worker_nodes(cluster)[-1])
    _assert_killed_mid_run(cluster, job_id, SHARDED_STEPS)
    done = wait_for_state(client, job_id, {"SUCCEEDED", "FAILED"}, timeout_s=240)
    assert done["state"] == "SUCCEEDED", done["error"]

    events = client.events(job_id)["items"]
    regroups = [e["data"] for e in events if e["data"] and "resumed_from" in e["data"]]
    assert [(data["resumed_from"], data["world_size_before"], data["world_size"]) for data in regroups] == [
        ("memory", 4, 3)
    ]
    restores = [e["data"] for e in events if e["data"] and e["data"].get("source") == "memory"]
    assert len(restores) == 1 and restores[0]["storage_reads"] == 0, restores
    twice, formations = _steps_computed_twice(cluster.storage, job_id, SHARDED_STEPS)
    assert formations == 2 and twice <= 1, f"{twice} steps computed twice over {formations} formations"
    rows = [row for row in client.metrics(job_id)["items"] if row["loss"] is not None]
    assert {row["world_size"] for row in rows} == {3, 4}
    assert [row["loss"] for row in rows] == pytest.approx(reference_24.losses, abs=1e-4)
    # Each step, as the formation that last ran it saw it, used a whole global batch of distinct samples.
    effective = read_effective_samples(cluster.storage / job_id)
    assert sorted(effective) == list(range(1, SHARDED_STEPS + 1))
    used = [sample for _, samples in effective.values() for sample in samples]
    assert all(len(samples) == SHRINK_BATCH for _, samples in effective.values()) and len(used) == len(set(used))


def test_a_node_lost_with_its_buddy_falls_back_to_the_durable_checkpoint(cluster, reference_24):
    """Three ranks, each shard's one copy on the next rank round the ring: two nodes lost together take a shard
    with its only copy. The survivor says which, and the job resumes from its durable checkpoint."""
    cluster.ensure_nodes(3)
    client = cluster.client
    job_id = client.submit(_sharded_spec("memory-buddy-lost", 3, 1))["id"]
    wait_for_recorded_step(cluster.storage / job_id, 6)  # past the durable checkpoint of step 4
    cluster.kill_nodes(_worker_nodes(cluster)[1:])
    killed_at = _assert_killed_mid_run(cluster, job_id, SHARDED_STEPS)
    done = wait_for_state(client, job_id, {"SUCCEEDED", "FAILED"}, timeout_s=240)
    assert done["state"] == "SUCCEEDED", done["error"]

    events = client.events(job_id)["items"]
    [fallback] = [e for e in events if e["data"] and "memory_fallback" in e["data"]]
    assert re.search(r"step \d+ lacks __\d_0\.distcp", fallback["data"]["memory_fallback"]), fallback
    assert "resuming from the durable checkpoint of step" in fallback["message"]
    regroups = [e["data"] for e in events if e["data"] and "resumed_from" in e["data"]]
    assert [(data["resumed_from"], data["world_size"]) for data in regroups] == [("storage", 1)]
    resumed_from = regroups[0]["resumed_from_step"]
    assert resumed_from % 4 == 0 and 4 <= resumed_from <= killed_at, (
        resumed_from,
        killed_at,
    )  # checkpoints every 4 steps
    assert resumed_from == fallback["data"]["resumed_from_step"]
    rows = [row for row in client.metrics(job_id)["items"] if row["loss"] is not None]
    assert [row["step"] for row in rows] == list(range(1, SHARDED_STEPS + 1))
    assert [row["loss"] for row in rows] == pytest.approx(reference_24.losses, abs=1e-4)


def test_a_member_lost_while_the_group_re_forms_is_left_out(cluster, reference_24):
    """Two nodes lost one after the other: the first dies, the second hangs a moment before (its raylet frozen,
    so neither Ray nor ringmaster's heartbeats have noticed it yet when the first death is seen). The driver
    re-forms the group with the hung node's rank still in it; Ray then declares that node dead mid-formation. The
    driver leaves the lost member out and forms again instead of failing the job: the attempt SUCCEEDS, resuming
    from the durable checkpoint (the two lost ranks held the only copies of each other's snapshot)."""
    cluster.ensure_nodes(3)
    client = cluster.client
    job_id = client.submit(_sharded_spec("memory-lost-while-forming", 2, 1))["id"]
    wait_for_recorded_step(cluster.storage / job_id, 6)  # past the durable checkpoint of step 4
    hung, dead = _worker_nodes(cluster)
    cluster.freeze_node(hung)
    try:
        cluster.kill_node(dead)
        _assert_killed_mid_run(cluster, job_id, SHARDED_STEPS)
        done = wait_for_state(client, job_id, {"SUCCEEDED", "FAILED"}, timeout_s=300)
    finally:
        cluster.kill_node(hung)  # a dead node left in the cluster would stall every later add_node
    assert done["state"] == "SUCCEEDED" and done["attempt"] == 1, done["error"]

    events = client.events(job_id)["items"]
    assert [e["to_state"] for e in events if e["to_state"] in ("RECOVERING", "RUNNING")] == [
        "RUNNING",
        "RECOVERING",
        "RUNNING",
    ]
    again = [e for e in events if "of the group being formed" in (e["message"] or "")]
    assert len(again) == 1 and again[0]["data"]["lost_nodes"] == [hung.node_id], again
    regroups = [e["data"] for e in events if e["data"] and "resumed_from" in e["data"]]
    assert [(data["resumed_from"], data["world_size_before"]) for data in regroups] == [("storage", 2)], regroups
    assert {rank["node_id"] for rank in regroups[0]["ranks"]}.isdisjoint({hung.node_id, dead.node_id})
    rows = [row for row in client.metrics(job_id)["items"] if row["loss"] is not None]
    assert [row["step"] for row in rows] == list(range(1, SHARDED_STEPS + 1))
    assert [row["loss"] for row in rows] == pytest.approx(reference_24.losses, abs=1e-4)
