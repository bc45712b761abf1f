"""Elastic recovery on a simulated multi-node cluster: nodes die, freeze and return mid-training, under managed
training and, last, a script job's (torchrun's restart of the whole group)."""

from __future__ import annotations

import json
import textwrap
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest
from ray.util.state import list_actors

from harness.local_control_plane import wait_for_state
from harness.simulated_cluster import SimulatedCluster, served_cluster, wait_for_step
from ringmaster.service.client import RingmasterClient
from ringmaster.workers.data.audit import read_effective_samples, read_steps_by_generation
from ringmaster.workers.driver.controller import COLLECTIVE_TIMEOUT_S
from tests.support.paced_model import read_tagged_steps

pytestmark = pytest.mark.integration

STEPS = 150
KILL_AFTER_STEP = 25
GLOBAL_BATCH = 8
SAMPLES = 96  # 12 steps an epoch: every run goes through 12 epochs and a half, so every failure is near a wrap


def _spec(cluster: SimulatedCluster, name: str, minimum: int, maximum: int) -> dict:
    return {
        "name": name,
        "model": "tests.support.paced_model:build",
        "model_options": {
            "pause_s": 0.03,
            "n_train": SAMPLES,
            "n_val": 64,
            "id_record_dir": str(cluster.id_records / name),
        },
        "workers": {"min": minimum, "max": maximum, "cpus_per_worker": 1},
        "train": {
            "steps": STEPS,
            "global_batch_size": GLOBAL_BATCH,
            "micro_batch_size": 2,
            "lr": 0.003,
            "seed": 3,
            "record_sample_ids": True,
        },
        "checkpoint": {"every_steps": 20, "keep": 3},
        "max_failures": 3,
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with served_cluster(2, tmp_path_factory.mktemp("elastic")) as simulated:
        simulated.id_records = tmp_path_factory.mktemp("ids-in-the-loss-path")
        yield simulated


@pytest.fixture(scope="module")
def uninterrupted(cluster) -> list[float]:
    """The reference trajectory: the same job, never disturbed, on two workers. Its steps are of a known length
    whatever the machine's speed (tests/support/paced_model.py): a standby has time to warm up mid-job, and a worker
    that starts warming up when the group shrinks is ready long before a one-worker group would finish the job."""
    cluster.ensure_nodes(2)
    job = cluster.client.submit(_spec(cluster, "reference", 2, 2))
    done = wait_for_state(cluster.client, job["id"], {"SUCCEEDED", "FAILED"}, timeout_s=300)
    assert done["state"] == "SUCCEEDED", done["error"]
    return _losses(cluster.client, job["id"])


def _losses(client: RingmasterClient, job_id: str) -> list[float]:
    rows = [row for row in client.metrics(job_id)["items"] if row["loss"] is not None]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    return [row["loss"] for row in rows]


def _worker_node(cluster: SimulatedCluster):
    actors = list_actors(
        address=cluster.dashboard_url, filters=[("class_name", "=", "TrainWorker"), ("state", "=", "ALIVE")]
    )
    return cluster.node_by_id(sorted(actor["node_id"] for actor in actors)[-1])


def _events(client: RingmasterClient, job_id: str) -> list[dict]:
    return client.events(job_id)["items"]


def _assert_each_sample_once_per_epoch(storage: Path, job_id: str) -> None:
    """The effective trajectory (each step as its last formation of the group ran it) uses every sample
    of an epoch at most once, and a finished epoch uses all of its samples."""
    effective = read_effective_samples(storage / job_id)
    assert sorted(effective) == list(range(1, STEPS + 1))
    by_epoch: dict[int, list[int]] = {}
    for epoch, sample_ids in effective.values():
        assert len(sample_ids) == GLOBAL_BATCH
        by_epoch.setdefault(epoch, []).extend(sample_ids)
    for epoch, sample_ids in by_epoch.items():
        assert len(sample_ids) == len(set(sample_ids)), f"epoch {epoch} used a sample twice"


def _assert_each_sample_once_per_epoch_in_the_loss_path(cluster: SimulatedCluster, name: str, job_id: str) -> None:
    """The same, from the ids the samples carried into the model (tests/support/paced_model.py), not ringmaster's
    record: every step used a global batch of distinct samples, and each epoch used every sample exactly once."""
    regroups = sum(1 for e in _events(cluster.client, job_id) if e["data"] and "resumed_from" in e["data"])
    steps, again = read_tagged_steps(cluster.id_records / name)
    assert len(steps) == STEPS and all(len(ids) == GLOBAL_BATCH for ids in steps), [len(ids) for ids in steps]
    # Per failure: the step whose snapshot was in flight, and the one it cut short.
    assert again <= 2 * regroups, f"{again} computations repeated samples over {regroups} re-formation(s)"
    per_epoch = SAMPLES // GLOBAL_BATCH
    for epoch in range(0, STEPS, per_epoch):
        used = [i for ids in steps[epoch : epoch + per_epoch] for i in ids]
        assert len(used) == len(set(used)), f"epoch {epoch // per_epoch} used a sample twice"
        if len(used) == SAMPLES:
            assert set(used) == set(range(SAMPLES)), f"epoch {epoch // per_epoch} left samples out"


def _assert_recovered_from_memory(cluster: SimulatedCluster, job_id: str) -> None:
    """Every re-formation resumed from the survivors' memory (checkpoint.in_memory is on for a multi-node group):
    no rank read storage to restore, and no optimizer step was computed by more than one formation of the group but
    the one a failure interrupted, counted from each rank's own step record."""
    events = _events(cluster.client, job_id)
    regroups = [e["data"] for e in events if e["data"] and "resumed_from" in e["data"]]
    assert regroups and {data["resumed_from"] for data in regroups} == {"memory"}, regroups
    restores = [e["data"] for e in events if e["data"] and e["data"].get("source") == "memory"]
    assert len(restores) == len(regroups) and {data["storage_reads"] for data in restores} == {0}, restores
    # ddp's state is on every rank alike: a node's loss leaves its copy on the other node, so only what is a rank's
    # own (its RNG state, here a sixth of this small model's snapshot) goes to a buddy. (A group of one has no buddy.)
    costs = [
        cost
        for e in events
        if e["data"] and "snapshot_host_memory" in e["data"]
        for cost in e["data"]["snapshot_host_memory"]
        if len(e["data"]["snapshot_host_memory"]) > 1
    ]
    assert costs and all(
        0 < cost["sent_bytes_per_snapshot"] == cost["copied_bytes_per_snapshot"] < 0.25 * cost["own_bytes_per_snapshot"]
        for cost in costs
    ), costs
    steps_by_generation = read_steps_by_generation(cluster.storage / job_id)
    computed = Counter(step for steps in steps_by_generation.values() for step in steps)
    assert len(steps_by_generation) == len(regroups) + 1
    assert sum(1 for times in computed.values() if times > 1) <= len(regroups), computed


def test_node_loss_with_replacement_resumes_exactly(cluster, uninterrupted):
    cluster.ensure_nodes(2)
    job = cluster.client.submit(_spec(cluster, "replace", 2, 2))
    wait_for_step(cluster.client, job["id"], KILL_AFTER_STEP)
    cluster.add_node()
    cluster.kill_node(_worker_node(cluster))
    done = wait_for_state(cluster.client, job["id"], {"SUCCEEDED", "FAILED"}, timeout_s=300)
    assert done["state"] == "SUCCEEDED", done["error"]
    transitions = [e["to_state"] for e in _events(cluster.client, job["id"]) if e["to_state"]]
    assert transitions == ["QUEUED", "ADMITTED", "RUNNING", "RECOVERING", "RUNNING", "SUCCEEDED"]
    resumed = next(
        e
        for e in _events(cluster.client, job["id"])
        if e["to_state"] == "RUNNING" and e["data"].get("resumed_from_step")
    )
    assert resumed["data"]["world_size"] == 2 and resumed["data"]["resumed_from_step"] >= KILL_AFTER_STEP - 1
    assert _losses(cluster.client, job["id"]) == pytest.approx(uninterrupted, abs=1e-6)
    _assert_each_sample_once_per_epoch(cluster.storage, job["id"])
    _assert_each_sample_once_per_epoch_in_the_loss_path(cluster, "replace", job["id"])
    _assert_recovered_from_memory(cluster, job["id"])


def test_node_loss_without_replacement_shrinks_then_grows_back(cluster, uninterrupted):
    cluster.ensure_nodes(2)
    # Snapshots on also at one worker (on one node they are off by default): the growth back resumes from memory too.
    spec = _spec(cluster, "shrink", 1, 2)
    job = cluster.client.submit({**spec, "checkpoint": {**spec["checkpoint"], "in_memory": {"replicas": 1}}})
    wait_for_step(cluster.client, job["id"], KILL_AFTER_STEP)
    cluster.kill_node(_worker_node(cluster))
    deadline = time.monotonic() + 60
    while not any(e["data"] and e["data"].get("world_size") == 1 for e in _events(cluster.client, job["id"])):
        assert time.monotonic() < deadline, "the group did not shrink onto the survivor"
        time.sleep(0.1)
    cluster.add_node()
    done = wait_for_state(cluster.client, job["id"], {"SUCCEEDED", "FAILED"}, timeout_s=300)
    assert done["state"] == "SUCCEEDED", done["error"]
    grown = [
        e for e in _events(cluster.client, job["id"]) if e["kind"] == "info" and "capacity returned" in e["message"]
    ]
    assert grown and grown[-1]["data"]["world_size"] == 2 and grown[-1]["data"]["world_size_before"] == 1
    rows = cluster.client.metrics(job["id"])["items"]
    assert {row["world_size"] for row in rows if row["loss"] is not None} >= {1, 2}
    # The global batch is kept (accumulation doubles at one worker), so the trajectory is the same run's.
    assert _losses(cluster.client, job["id"]) == pytest.approx(uninterrupted, abs=1e-4)
    _assert_each_sample_once_per_epoch(cluster.storage, job["id"])
    _assert_each_sample_once_per_epoch_in_the_loss_path(cluster, "shrink", job["id"])
    _assert_recovered_from_memory(cluster, job["id"])


def test_frozen_node_is_detected_within_seconds_and_recovered(cluster, uninterrupted):
    cluster.ensure_nodes(2)
    job = cluster.client.submit(_spec(cluster, "frozen", 1, 2))
    wait_for_step(cluster.client, job["id"], KILL_AFTER_STEP)
    frozen_node, frozen_at = _worker_node(cluster), time.time()
    cluster.freeze_node(frozen_node)
    try:
        done = wait_for_state(cluster.client, job["id"], {"SUCCEEDED", "FAILED"}, timeout_s=300)
    finally:
        cluster.kill_node(frozen_node)  # a dead node left in the cluster would stall every later add_node
    assert done["state"] == "SUCCEEDED", done["error"]
    recovering = next(e for e in _events(cluster.client, job["id"]) if e["to_state"] == "RECOVERING")
    detected_after = datetime.fromisoformat(recovering["at"]).timestamp() - frozen_at
    print(f"the frozen node was declared lost {detected_after:.1f}s after it froze", flush=True)
    assert frozen_node.node_id in recovering["data"]["lost_nodes"], recovering
    # A mechanism check, not a timing race: the driver's heartbeats (HEARTBEAT_TIMEOUT_S, 3 s) or Ray's node health
    # checks (FAST_HEALTH_CHECKS, a few seconds) notice a frozen node; a collective blocked on it fails only after
    # COLLECTIVE_TIMEOUT_S (60 s, 20 times the heartbeats'). Noticed before that, the backstop played no part.
    assert detected_after < COLLECTIVE_TIMEOUT_S, (
        f"the frozen node was declared lost only after {detected_after:.1f}s: the collective timeout's backstop "
        f"({COLLECTIVE_TIMEOUT_S:.0f}s), not the heartbeats"
    )
    assert _losses(cluster.client, job["id"]) == pytest.approx(uninterrupted, abs=1e-4)
    _assert_each_sample_once_per_epoch_in_the_loss_path(cluster, "frozen", job["id"])
    _assert_recovered_from_memory(cluster, job["id"])


def test_warm_standby_replaces_a_lost_worker_and_resumes_exactly(cluster, uninterrupted):
    cluster.ensure_nodes(3)  # two nodes for the group, one idle for the standby
    spec = _spec(cluster, "standby", 2, 2)
    job = cluster.client.submit({**spec, "workers": {**spec["workers"], "standby": 1}})
    deadline = time.monotonic() + 120
    while not (ready := [e for e in _events(cluster.client, job["id"]) if e["data"] and "standby_node" in e["data"]]):
        assert time.monotonic() < deadline, "no standby worker became ready"
        time.sleep(0.1)
    standby_node = ready[0]["data"]["standby_node"]
    actors = list_actors(
        address=cluster.dashboard_url, filters=[("class_name", "=", "TrainWorker"), ("state", "=", "ALIVE")]
    )
    cluster.kill_node(
        cluster.node_by_id(next(actor["node_id"] for actor in actors if actor["node_id"] != standby_node))
    )
    done = wait_for_state(cluster.client, job["id"], {"SUCCEEDED", "FAILED"}, timeout_s=300)
    assert done["state"] == "SUCCEEDED", done["error"]
    resumed = next(
        e
        for e in _events(cluster.client, job["id"])
        if e["to_state"] == "RUNNING" and "standby_workers_used" in (e["data"] or {})
    )
    assert resumed["data"]["standby_workers_used"] == 1 and resumed["data"]["world_size"] == 2
    assert _losses(cluster.client, job["id"]) == pytest.approx(uninterrupted, abs=1e-6)
    _assert_each_sample_once_per_epoch(cluster.storage, job["id"])
    _assert_each_sample_once_per_epoch_in_the_loss_path(cluster, "standby", job["id"])
    _assert_recovered_from_memory(cluster, job["id"])


# A script job's run (script mode: the team's own torchrun script): its steps, and the one after which a node dies.
SCRIPT_STEPS = 30
SCRIPT_KILL_AFTER_STEP = 6

# A torchrun DDP script that checkpoints every step and resumes from its newest checkpoint, as elastic scripts do.
RESUMING_SCRIPT = f"""
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ringmaster

checkpoints = Path(os.environ["RINGMASTER_CHECKPOINT_DIR"])
dist.init_process_group("gloo")
rank = dist.get_rank()
model = nn.parallel.DistributedDataParallel(nn.Linear(2, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
if (checkpoints / "latest.pt").exists():
    state = torch.load(checkpoints / "latest.pt")
    model.module.load_state_dict(state["model"])
    start = state["step"] + 1
if rank == 0:
    run = {{name: os.environ[name] for name in ("TORCHELASTIC_RESTART_COUNT", "WORLD_SIZE")}} | {{"start": start}}
    with (checkpoints / "runs.jsonl").open("a") as runs:
        runs.write(json.dumps(run) + "\\n")
for step in range(start, {SCRIPT_STEPS}):
    loss = model(torch.ones(4, 2)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if rank == 0:
        torch.save({{"model": model.module.state_dict(), "step": step}}, checkpoints / "next.pt")
        os.replace(checkpoints / "next.pt", checkpoints / "latest.pt")
        ringmaster.report(step, loss=loss.item())
    time.sleep(0.2)
dist.destroy_process_group()
"""


def test_a_script_jobs_group_restarts_at_one_worker_on_a_lost_node_and_resumes_from_its_checkpoint(
    cluster, tmp_path: Path
) -> None:
    """Script mode's elastic semantics: a node killed mid-run stops every process of the group, which starts again at
    the size the elastic rules choose (workers.min 1, max 2: the one left), with TORCHELASTIC_RESTART_COUNT 1, and the
    script resumes from its own checkpoint in RINGMASTER_CHECKPOINT_DIR."""
    cluster.ensure_nodes(2)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(RESUMING_SCRIPT).lstrip())
    client = cluster.client
    job = client.submit(
        {
            "name": "script-elastic",
            "command": ["python", str(script)],
            "workers": {"min": 1, "max": 2, "cpus_per_worker": 1},
            "max_failures": 2,
            "stop_grace_s": 5,
        }
    )
    deadline = time.monotonic() + 240  # the job's start included: a loaded machine takes minutes
    while not any(row["step"] >= SCRIPT_KILL_AFTER_STEP for row in client.metrics(job["id"])["items"]):
        assert time.monotonic() < deadline, "the script never reached the step to kill a node at"
        time.sleep(0.1)
    workers = list_actors(
        address=cluster.dashboard_url, filters=[("class_name", "=", "ScriptWorker"), ("state", "=", "ALIVE")]
    )
    assert len(workers) == 2
    cluster.kill_node(cluster.node_by_id(max(worker["node_id"] for worker in workers)))  # rank 1's node

    done = wait_for_state(client, job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout_s=180)
    assert done["state"] == "SUCCEEDED", done["error"]
    events = client.events(job["id"])["items"]
    assert [event["to_state"] for event in events if event["to_state"]] == [
        "QUEUED",
        "ADMITTED",
        "RUNNING",
        "RECOVERING",
        "RUNNING",
        "SUCCEEDED",
    ]
    restarted = [event["data"] for event in events if event["to_state"] == "RUNNING"][-1]
    assert restarted["world_size"] == 1 and restarted["restart_count"] == 1
    runs = [json.loads(line) for line in (Path(restarted["checkpoint_dir"]) / "runs.jsonl").read_text().splitlines()]
    assert [(run["TORCHELASTIC_RESTART_COUNT"], run["WORLD_SIZE"]) for run in runs] == [("0", "2"), ("1", "1")]
    assert runs[0]["start"] == 0 and runs[1]["start"] > SCRIPT_KILL_AFTER_STEP, runs
    steps = sorted(row["step"] for row in client.metrics(job["id"])["items"])
    assert steps[-1] == SCRIPT_STEPS - 1


def test_a_drained_nodes_job_moves_off_it_before_the_deadline_with_no_step_redone(cluster, uninterrupted):
    """A node drained through the API (Ray's drain: a spot instance's notice) while a job at its workers.min trains
    there: the job saves at its next step and stops, goes back to the queue in its place, and resumes on the other
    node from that step, long before the deadline; nothing is computed twice, no failure is counted, and its losses
    are the undisturbed run's. Last in the module: the drained node takes nothing new afterwards."""
    cluster.ensure_nodes(2)
    client = cluster.client
    job = client.submit(_spec(cluster, "drained", 1, 1))
    wait_for_step(client, job["id"], KILL_AFTER_STEP)
    drained = _worker_node(cluster)
    began = time.monotonic()
    answer = client.drain_node(drained.node_id, deadline_s=120, reason="spot instance notice")
    assert answer["node_id"] == drained.node_id and answer["deadline"] is not None

    def moved() -> bool:
        return client.job(job["id"])["attempt"] == 2 and client.job(job["id"])["state"] == "RUNNING"

    while not moved():
        assert time.monotonic() - began < 120, f"still {client.job(job['id'])['state']} at the drain's deadline"
        time.sleep(0.2)
    print(f"drain to training again on the other node: {time.monotonic() - began:.1f} s")
    assert _worker_node(cluster).node_id != drained.node_id, "resumed on the node that drains"

    done = wait_for_state(client, job["id"], {"SUCCEEDED", "FAILED"}, timeout_s=300)
    assert done["state"] == "SUCCEEDED", done["error"]
    assert (done["attempt"], done["failures"], done["preemptions"], done["preempted_for"]) == (2, 0, 1, None)
    events = _events(client, job["id"])
    assert [e["to_state"] for e in events if e["to_state"]] == [
        "QUEUED",
        "ADMITTED",
        "RUNNING",
        "PREEMPTED",
        "QUEUED",
        "ADMITTED",
        "RUNNING",
        "SUCCEEDED",
    ]
    [asked] = [e for e in events if e["message"].startswith("preempting:")]
    assert f"its node {drained.node_id[:12]} is draining, which goes in" in asked["message"], asked["message"]
    [preempted] = [e for e in events if e["to_state"] == "PREEMPTED"]
    assert "moving off a draining node" in preempted["message"]
    rows = client.metrics(job["id"])["items"]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1)), "every step once"
    saved_at = preempted["data"]["step"]
    assert {row["attempt"] for row in rows if row["step"] > saved_at} == {2}
    steps, redone = read_tagged_steps(cluster.id_records / "drained")
    assert (len(steps), redone) == (STEPS, 0), "a step computed again after the move"
    assert _losses(client, job["id"]) == pytest.approx(uninterrupted, abs=1e-4)
