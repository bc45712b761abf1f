"""The scheduler across jobs on a real Ray: a job of higher priority preempts a running one, which saves at a step
boundary, goes back to the queue in its place and resumes from what it saved, with no step computed twice and no
failure counted."""

from __future__ import annotations

from datetime import datetime

import pytest

from harness.local_control_plane import running_control_plane, wait_for_state
from tests.support.paced_model import read_tagged_steps

pytestmark = pytest.mark.integration

LOW_STEPS = 40


@pytest.fixture(scope="module")
def preempting_server(tmp_path_factory, shared_ray_head):
    """A control plane that may preempt a job as soon as it runs (the default protects a job's first 300 s)."""
    yield from running_control_plane(
        tmp_path_factory.mktemp("scheduling"), head=shared_ray_head, min_run_before_preemption_s=0
    )


def _paced(name: str, workers: int, cpus: int, steps: int, priority: int, id_record_dir: str) -> dict:
    return {
        "name": name,
        "model": "tests.support.paced_model:build",
        "model_options": {"pause_s": 0.05, "n_train": 96, "n_val": 16, "id_record_dir": id_record_dir},
        "priority": priority,
        "workers": {"min": workers, "max": workers, "cpus_per_worker": cpus},
        "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "lr": 0.003, "seed": 5},
        "checkpoint": {"every_steps": 100},  # only the save a preemption asks for, and the final one
        "max_failures": 0,
    }


def _at(event: dict) -> datetime:
    return datetime.fromisoformat(event["at"])


def test_a_low_priority_job_is_preempted_whole_resumes_from_its_save_and_both_succeed(preempting_server, tmp_path):
    client = preempting_server.client()
    low = client.submit(_paced("low", 2, 2, LOW_STEPS, 0, str(tmp_path / "low")))  # the whole 4-CPU head
    wait_for_state(client, low["id"], {"RUNNING"}, timeout_s=120)
    while not [row for row in client.metrics(low["id"])["items"] if row["step"] >= 3]:
        assert client.job(low["id"])["state"] == "RUNNING"
    high = client.submit(_paced("high", 2, 1, 8, 9, str(tmp_path / "high")))

    done_high = wait_for_state(client, high["id"], {"SUCCEEDED", "FAILED"}, timeout_s=240)
    assert done_high["state"] == "SUCCEEDED", done_high["error"]
    done_low = wait_for_state(client, low["id"], {"SUCCEEDED", "FAILED"}, timeout_s=240)
    assert done_low["state"] == "SUCCEEDED", done_low["error"]

    events = client.events(low["id"])["items"]
    transitions = [event["to_state"] for event in events if event["to_state"]]
    assert transitions == ["QUEUED", "ADMITTED", "RUNNING", "PREEMPTED", "QUEUED", "ADMITTED", "RUNNING", "SUCCEEDED"]
    [preempted] = [event for event in events if event["to_state"] == "PREEMPTED"]
    assert preempted["data"]["preempted_for"] == high["id"]
    saved_at = preempted["data"]["step"]
    [requeued] = [
        event for event in events if event["to_state"] == "QUEUED" and (event["data"] or {}).get("preemptions")
    ]
    assert requeued["data"]["preemptions"] == 1
    assert (done_low["attempt"], done_low["failures"], done_low["preemptions"]) == (2, 0, 1), "not a failure"
    assert done_low["preempted_for"] == high["id"]

    # The high-priority job started only once the low one had saved and stopped.
    admitted_high = next(event for event in client.events(high["id"])["items"] if event["to_state"] == "ADMITTED")
    assert _at(admitted_high) >= _at(preempted)

    # The second attempt went on from the step saved: every step once, none computed twice.
    rows = client.metrics(low["id"])["items"]
    assert [row["step"] for row in rows] == list(range(1, LOW_STEPS + 1))
    assert {row["attempt"] for row in rows if row["step"] > saved_at} == {2}
    assert {row["attempt"] for row in rows if row["step"] <= saved_at} == {1}
    steps, redone = read_tagged_steps(tmp_path / "low")
    assert (len(steps), redone) == (LOW_STEPS, 0), "a step computed again after the preemption"
