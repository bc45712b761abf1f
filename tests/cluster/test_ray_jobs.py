"""End to end on a real local Ray: REST submit → queue → gang admission → Ray job → DDP → checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import ray
import yaml

from harness.local_control_plane import CLUSTER_CPUS, REPO_ROOT
from harness.local_control_plane import wait_for_state as _wait
from ringmaster.service.client import RingmasterClient

pytestmark = pytest.mark.integration


def _spec(name: str, **overrides) -> dict:
    spec = {
        "name": name,
        "model": "tiny-gpt",
        "data": "pysource",
        "strategy": "ddp",
        "workers": {"min": 2, "max": 2, "gpus_per_worker": 0, "cpus_per_worker": 1},
        "train": {
            "steps": 30,
            "global_batch_size": 16,
            "micro_batch_size": 4,
            "lr": 0.003,
            "warmup_steps": 3,
            "seed": 0,
        },
        "checkpoint": {"every_steps": 10, "keep": 2},
    }
    spec.update(overrides)
    return spec


def _cluster_is_idle(timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) == CLUSTER_CPUS:
            return True
        time.sleep(0.25)
    return False


def _cancel_once_training(client: RingmasterClient, name: str) -> tuple[dict, dict]:
    """Submit a long job, cancel it after its first reported step, and check the cluster is idle soon after."""
    job = client.submit(_spec(name, train={"steps": 100000, "global_batch_size": 8, "micro_batch_size": 4}))
    _wait(client, job["id"], {"RUNNING"}, timeout_s=120)
    deadline = time.monotonic() + 60
    while not client.metrics(job["id"])["items"]:
        assert time.monotonic() < deadline, "no training step was reported"
        time.sleep(0.25)
    cancelled = client.cancel(job["id"])
    assert cancelled["state"] == "CANCELLED"
    assert _cluster_is_idle(15), f"resources still held after cancel: {ray.available_resources()}"
    return job, cancelled


def test_ddp_job_over_rest_succeeds_with_falling_loss_and_a_checkpoint(client: RingmasterClient, ray_server):
    job = client.submit(_spec("e2e-ddp"))
    assert job["state"] == "QUEUED"
    done = _wait(client, job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert done["state"] == "SUCCEEDED", done["error"]
    assert done["ray_job_id"] == f"ringmaster-{job['id']}-1"
    assert done["dashboard_url"].endswith(f"/#/jobs/{done['ray_job_id']}")
    assert done["started_at"] and done["finished_at"]

    transitions = [(e["from_state"], e["to_state"]) for e in client.events(job["id"])["items"] if e["to_state"]]
    assert transitions == [(None, "QUEUED"), ("QUEUED", "ADMITTED"), ("ADMITTED", "RUNNING"), ("RUNNING", "SUCCEEDED")]

    rows = client.metrics(job["id"])["items"]
    losses = [row["loss"] for row in rows if row["loss"] is not None]
    assert [row["step"] for row in rows] == list(range(1, 31))
    assert len(losses) == 30 and all(row["world_size"] == 2 for row in rows)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, f"loss did not fall: {losses}"
    assert rows[-1]["val_loss"] is not None and rows[-1]["val_loss"] < losses[0]

    checkpoints = client.checkpoints(job["id"])["items"]
    assert [c["step"] for c in checkpoints] == [20, 30] and checkpoints[-1]["final"], "rows follow retention on storage"
    final = Path(checkpoints[-1]["uri"])
    assert json.loads((final / "manifest.json").read_text())["step"] == 30
    assert any(final.glob("*.distcp")), "the final checkpoint holds no tensor data"
    kept = sorted(path.name for path in final.parent.iterdir())
    assert kept == ["step-00000020", "step-00000030", "tensorboard"], "retention keeps the newest checkpoint.keep"
    _check_tensorboard_events(final.parent / "tensorboard" / "attempt-1", rows)

    driver_log = client.logs(job["id"])
    assert f"job {job['id']} attempt 1 ended with code 0" in driver_log
    _check_the_dashboards_view(ray_server, job["id"], done["ray_job_id"], driver_log)


def _check_tensorboard_events(directory: Path, rows: list[dict]) -> None:
    """The job's event files hold every step's scalars, equal (as float32) to what the API reports."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    assert {
        "train/loss",
        "train/val_loss",
        "train/lr",
        "train/grad_norm",
        "train/samples_per_s",
        "train/world_size",
        "train/recoveries",
    } <= set(events.Tags()["scalars"]), events.Tags()

    def series(tag: str) -> dict[int, float]:
        return {event.step: event.value for event in events.Scalars(tag)}

    for field, tag in (
        ("loss", "train/loss"),
        ("lr", "train/lr"),
        ("grad_norm", "train/grad_norm"),
        ("world_size", "train/world_size"),
    ):
        expected = {row["step"]: np.float32(row[field]) for row in rows if row[field] is not None}
        assert series(tag) == {step: float(value) for step, value in expected.items()}, tag
    assert set(series("train/val_loss")) == {30} and set(series("train/recoveries").values()) == {0.0}


def _check_the_dashboards_view(ray_server, job_id: str, submission_id: str, driver_log: str) -> None:
    """What the Ray dashboard shows of the job: named metadata, a short entrypoint, a training log, the job's worker
    actors, and training series on the node's Prometheus endpoint."""
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import get_actor

    info = JobSubmissionClient(ray_server.dashboard_url).get_job_info(submission_id)
    assert info.metadata["job_name"] == f"e2e-ddp ({job_id[:8]}, attempt 1)"
    assert {
        key: info.metadata[key] for key in ("ringmaster_job_id", "tenant", "attempt", "strategy", "world_size")
    } == {"ringmaster_job_id": job_id, "tenant": "default", "attempt": "1", "strategy": "ddp", "world_size": "2"}
    assert info.metadata["ringmaster_url"].endswith(f"/ui/jobs/{job_id}")
    assert len(info.entrypoint) < 400 and "e2e-ddp" not in info.entrypoint, info.entrypoint

    assert "HTTP Request" not in driver_log, "no line per report"
    assert "[RUNNING] training on 2 workers across 1 node(s)" in driver_log
    assert re.search(r"step \d+/30  loss \d+\.\d{4}  [\d.]+ samples/s  lr [\d.e-]+  world size 2", driver_log), (
        driver_log
    )
    assert "checkpoint committed at step 20" in driver_log and "checkpoint committed at step 30" in driver_log
    assert re.search(r"validation loss \d+\.\d{4} at step 30", driver_log)

    # Each rank is a named actor: the job's own (under its Ray job) or a warm pool worker (under the control plane's).
    running = next(e for e in ray_server.client().events(job_id)["items"] if e["to_state"] == "RUNNING")
    ranks = running["data"]["ranks"]
    assert sorted(rank["rank"] for rank in ranks) == [0, 1]
    for rank in ranks:
        actor = get_actor(rank["actor_id"], address=ray_server.plane.settings.ray_address)
        assert actor is not None and actor.name == rank["name"] and actor.pid == rank["pid"], (rank, actor)
        assert rank["name"].startswith(("warm-worker:shared:", f"e2e-ddp-{job_id[:8]}-a1-w")), rank
        assert f"rank {rank['rank']}: pid {rank['pid']}" in driver_log and rank["actor_id"] in driver_log

    # Ray exports a process's metrics periodically: the final step arrives with the driver's last export, which it
    # lives through after the job has ended.
    deadline = time.monotonic() + 30
    while (series := _training_series(ray_server.ray_metrics_url, job_id)).get("step") != 30:
        assert time.monotonic() < deadline, f"the job's final step never reached the node's metrics endpoint: {series}"
        time.sleep(1.0)
    assert {"loss", "samples_per_s", "step", "world_size", "recoveries"} <= set(series), series
    assert series["world_size"] == 2 and series["recoveries"] == 0


def _training_series(metrics_url: str, job_id: str) -> dict[str, float]:
    """ringmaster_train_<name> -> value for this job, from a Prometheus text page (Ray may prefix `ray_`)."""
    import httpx

    found = {}
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        match = re.match(r"^(?:ray_)?ringmaster_train_(\w+)\{([^}]*)\} (\S+)$", line)
        if match and f'job_id="{job_id}"' in match.group(2):
            found[match.group(1)] = float(match.group(3))
    return found
    assert _cluster_is_idle(15), "the job's placement group was not freed"


def test_cancel_running_job_stops_it_and_frees_ray_resources(client: RingmasterClient):
    job, cancelled = _cancel_once_training(client, "e2e-cancel")
    from ray.job_submission import JobSubmissionClient

    jobs_api = JobSubmissionClient(client.job(job["id"])["dashboard_url"].split("/#")[0])
    deadline = time.monotonic() + 15
    while str(jobs_api.get_job_status(cancelled["ray_job_id"]).value) != "STOPPED":
        assert time.monotonic() < deadline, "the Ray job was not stopped"
        time.sleep(0.25)
    with pytest.raises(Exception, match="409"):
        client.cancel(job["id"])
    # The driver's log says why it stopped, with no crash dump of Ray's SIGTERM handler.
    driver_log = jobs_api.get_job_logs(cancelled["ray_job_id"])
    assert "stop requested (SIGTERM, as a cancel sends it)" in driver_log and "SIGTERM received" not in driver_log, (
        driver_log
    )


def test_a_rank_whose_process_dies_on_a_live_node_is_replaced_within_the_attempt(client: RingmasterClient):
    """A training process killed (as the OOM killer or a crash ends one) while its node lives: its bundle is free on
    that node, so the driver starts a replacement there at once and the attempt goes on. It used to take the node for
    dead and, on a cluster with no other node, wait for capacity until it gave the attempt up."""
    job = client.submit(
        _spec(
            "e2e-process-death",
            train={"steps": 400, "global_batch_size": 16, "micro_batch_size": 4, "lr": 0.003, "seed": 0},
        )
    )
    _wait(client, job["id"], {"RUNNING"}, timeout_s=120)
    deadline = time.monotonic() + 60
    while not client.metrics(job["id"])["items"]:
        assert time.monotonic() < deadline, "no training step was reported"
        time.sleep(0.25)
    running = next(e for e in client.events(job["id"])["items"] if e["to_state"] == "RUNNING")
    victim = running["data"]["ranks"][1]
    os.kill(victim["training_pid"], signal.SIGKILL)
    killed = time.monotonic()
    deadline = killed + 60
    while not [e for e in client.events(job["id"])["items"] if e["to_state"] == "RUNNING"][1:]:
        assert time.monotonic() < deadline, f"not re-formed within 60 s: {client.events(job['id'])['items'][-3:]}"
        time.sleep(0.25)
    reformed_after = time.monotonic() - killed
    done = _wait(client, job["id"], {"SUCCEEDED", "FAILED"})
    assert done["state"] == "SUCCEEDED" and done["attempt"] == 1, done["error"]
    events = client.events(job["id"])["items"]
    recovering = next(e for e in events if e["to_state"] == "RECOVERING")
    assert recovering["data"]["lost_pids"] == [victim["pid"]], recovering
    reformed = [e for e in events if e["to_state"] == "RUNNING"][1]
    assert reformed["data"]["world_size"] == 2 and reformed_after < 30, (reformed_after, reformed)
    assert {rank["node_id"] for rank in reformed["data"]["ranks"]} == {victim["node_id"]}
    # The survivor's interrupted call is one line of the driver's log, not Ray's whole "Unhandled error" traceback.
    from ray.job_submission import JobSubmissionClient

    driver_log = JobSubmissionClient(done["dashboard_url"].split("/#")[0]).get_job_logs(done["ray_job_id"])
    assert "rank 0's interrupted training call ended: " in driver_log and "Unhandled error" not in driver_log, (
        driver_log
    )


def test_gang_admission_leaves_a_too_large_job_queued_while_a_small_one_runs(client: RingmasterClient):
    big = client.submit(
        _spec(
            "e2e-big",
            workers={"min": 8, "max": 8},
            train={"steps": 5, "global_batch_size": 32, "micro_batch_size": 4},
            priority=5,
        )
    )
    small = client.submit(
        _spec(
            "e2e-small",
            model="mlp",
            data="synthetic",
            checkpoint={"every_steps": 0, "keep": 1},
            train={"steps": 5, "global_batch_size": 8, "micro_batch_size": 4},
        )
    )
    assert _wait(client, small["id"], {"SUCCEEDED", "FAILED"})["state"] == "SUCCEEDED"
    waiting = client.job(big["id"])
    assert waiting["state"] == "QUEUED"
    # The cluster, idle, could not hold it: read from Ray's own account of its nodes.
    assert waiting["waiting_reason"] == (
        f"the cluster's nodes hold only {CLUSTER_CPUS} workers of 1 CPUs each even when idle; it needs 8: it waits "
        "for nodes to join"
    ), waiting["waiting_reason"]
    client.cancel(big["id"])


def test_user_entrypoint_trains_through_ray(client: RingmasterClient):
    spec = yaml.safe_load((REPO_ROOT / "examples" / "user-model.yaml").read_text())
    spec["train"]["steps"] = 10
    job = client.submit(spec)
    done = _wait(client, job["id"], {"SUCCEEDED", "FAILED"})
    assert done["state"] == "SUCCEEDED", done["error"]
    rows = client.metrics(job["id"])["items"]
    assert rows[-1]["step"] == 10 and rows[-1]["world_size"] == 2


def test_exception_in_user_code_fails_the_job_once_with_its_traceback(client: RingmasterClient):
    spec = yaml.safe_load((REPO_ROOT / "examples" / "user-model.yaml").read_text())
    spec["model_options"]["text_path"] = "/nonexistent/corpus.txt"
    job = client.submit(spec)
    done = _wait(client, job["id"], {"SUCCEEDED", "FAILED"})
    assert done["state"] == "FAILED"
    assert "FileNotFoundError" in done["error"] and "Traceback" in done["error"] and "user_model.py" in done["error"]
    # The training process's traceback alone: its exception stated once, no frames of the actor that handed it on.
    error = done["error"]
    assert error.count("FileNotFoundError: [Errno 2]") == 1 and "workers/worker.py" not in error, error
    # Headed by where it was raised: the rank in its group, the training process and its node, not Ray's actor ids.
    assert re.match(r"training raised an exception on rank [01] of 2, pid \d+, node [\d.]+\nTraceback", error), error
    assert done["attempt"] == 1


def test_a_job_starts_in_warm_pool_workers_which_end_with_it(client: RingmasterClient):
    from ringmaster.workers.warm_pool import pool_workers

    def pool() -> list[dict]:
        return list(pool_workers().values())

    deadline = time.monotonic() + 120
    while sum(status["warm"] and status["claimant"] is None for status in pool()) < 2:
        assert time.monotonic() < deadline, f"the dispatcher did not keep two warm pool workers: {pool()}"
        time.sleep(0.5)
    job = client.submit(
        _spec(
            "e2e-warm-pool",
            model="mlp",
            data="synthetic",
            checkpoint={"every_steps": 0, "keep": 1},
            train={"steps": 5, "global_batch_size": 8, "micro_batch_size": 4},
        )
    )
    done = _wait(client, job["id"], {"SUCCEEDED", "FAILED"})
    assert done["state"] == "SUCCEEDED", done["error"]
    running = next(e for e in client.events(job["id"])["items"] if e["to_state"] == "RUNNING")
    assert running["data"]["warm_pool_workers"] == 2, running
    deadline = time.monotonic() + 30
    while any(status["claimant"] == done["ray_job_id"] for status in pool()):
        assert time.monotonic() < deadline, "the job's pool workers outlived it"
        time.sleep(0.5)
    assert _cluster_is_idle(15)


def test_a_cancelled_jobs_driver_stops_itself_when_ray_does_not_stop_it(client: RingmasterClient, monkeypatch):
    """The control plane answers the driver's next report with CANCELLED: the driver frees its workers and bundles on
    its own. Here the dispatcher's Ray job stop and placement-group release reach nothing, as when the dashboard
    stalls."""
    from ray.job_submission import JobSubmissionClient

    from ringmaster.service.ray_cluster import RayCluster
    from ringmaster.workers.warm_pool import pool_workers

    monkeypatch.setattr(RayCluster, "stop", lambda self, submission_id: None)
    monkeypatch.setattr(RayCluster, "release", lambda self, name: None)
    job, cancelled = _cancel_once_training(client, "e2e-cancel-unheard")
    assert not any(status["claimant"] == cancelled["ray_job_id"] for status in pool_workers().values())

    jobs_api = JobSubmissionClient(client.job(job["id"])["dashboard_url"].split("/#")[0])
    deadline = time.monotonic() + 30
    while str(jobs_api.get_job_status(cancelled["ray_job_id"]).value) != "SUCCEEDED":
        assert time.monotonic() < deadline, (
            f"the driver did not end: {jobs_api.get_job_status(cancelled['ray_job_id'])}"
        )
        time.sleep(0.25)
    assert "the control plane ended this attempt (job CANCELLED): stopping" in jobs_api.get_job_logs(
        cancelled["ray_job_id"]
    )
