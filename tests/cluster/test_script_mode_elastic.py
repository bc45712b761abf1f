"""Script mode's elastic semantics on a simulated two-node cluster: a node killed mid-run stops every process of the
group, which starts again at the size the elastic rules choose (workers.min 1, max 2: the one left), with
TORCHELASTIC_RESTART_COUNT 1, and the script resumes from its own checkpoint in RINGMASTER_CHECKPOINT_DIR."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest
from ray.util.state import list_actors

from harness.local_control_plane import wait_for_state
from harness.simulated_cluster import served_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 30
KILL_AFTER_STEP = 6

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
for step in range(start, {STEPS}):
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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with served_cluster(2, tmp_path_factory.mktemp("script-elastic")) as simulated:
        yield simulated


def test_a_killed_node_restarts_the_group_at_one_worker_which_resumes_from_its_checkpoint(
    cluster, tmp_path: Path
) -> None:
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
    deadline = time.monotonic() + 120
    while not any(row["step"] >= KILL_AFTER_STEP for row in client.metrics(job["id"])["items"]):
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
    assert runs[0]["start"] == 0 and runs[1]["start"] > KILL_AFTER_STEP, runs
    steps = sorted(row["step"] for row in client.metrics(job["id"])["items"])
    assert steps[-1] == STEPS - 1
