"""Each job as an MLflow run, against a real MLflow tracking server (SQLite backend) this test starts: the JobSpec as
parameters, every step's metrics, checkpoint URIs as tags, the final state as the run's status."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.ports import free_port
from harness.standin_cluster import StandInCluster
from ringmaster.service import jobs
from ringmaster.service.db import session_scope
from ringmaster.service.dispatcher import Dispatcher
from ringmaster.service.models import Job
from ringmaster.service.reports import CheckpointRecord, DriverReport, MetricPoint
from ringmaster.service.settings import Settings
from ringmaster.service.spec import JobSpec
from ringmaster.service.states import JobState

pytest.importorskip("mlflow", reason="the MLflow tests need mlflow (the test extra)")


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.communicate()[1][-3000:]
            try:
                if httpx.get(f"{uri}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the MLflow server did not start"
            time.sleep(0.5)
        yield uri
    finally:
        server.terminate()
        server.wait(timeout=30)


def _job(db, name: str, dispatcher: Dispatcher) -> str:
    spec = JobSpec.model_validate(
        {
            "name": name,
            "model": "mlp",
            "workers": {"min": 1, "max": 1},
            "train": {"steps": 3, "global_batch_size": 4, "micro_batch_size": 4, "lr": 0.02},
        }
    )
    with session_scope(db.sessions) as session:
        job_id = jobs.submit_job(session, spec).id
    dispatcher.run_once()
    return job_id


def _report(db, job_id: str, seq: int, **fields) -> None:
    with session_scope(db.sessions) as session:
        jobs.apply_driver_report(session, job_id, 1, DriverReport(seq=seq, **fields))


def test_a_job_is_a_run_with_its_spec_metrics_checkpoints_and_final_state(
    db, tracking_uri: str, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    from ringmaster.service.mlflow_export import MlflowExporter

    dispatcher = Dispatcher(
        db.sessions, StandInCluster(), Settings(data_dir=tmp_path, api_url="http://control-plane:8765")
    )
    experiment = f"ringmaster-test-{time.time_ns()}"
    exporter = MlflowExporter(db.sessions, tracking_uri, experiment)
    job_id = _job(db, "tracked", dispatcher)
    now = time.time()
    _report(db, job_id, 1, state="RUNNING", message="training on 1 workers")
    _report(
        db,
        job_id,
        2,
        metrics=[
            MetricPoint(
                step=step,
                loss=1.0 / step,
                lr=0.02,
                grad_norm=0.5 * step,
                samples_per_s=100.0,
                world_size=1,
                wall_time=now + step,
                user_metrics={"accuracy": 0.25 * step},
            )
            for step in (1, 2)
        ],
    )
    exporter.run_once()

    client = MlflowClient(tracking_uri=tracking_uri)
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "RUNNING" and run.info.run_name == "tracked"
    assert run.data.tags["ringmaster.job_id"] == job_id and run.data.tags["ringmaster.tenant"] == "default"
    assert (run.data.params["train.lr"], run.data.params["model"], run.data.params["workers.max"]) == (
        "0.02",
        "mlp",
        "1",
    )

    _report(
        db,
        job_id,
        3,
        metrics=[MetricPoint(step=3, loss=1 / 3, val_loss=0.4, lr=0.02, world_size=1, wall_time=now + 3)],
        checkpoints=[CheckpointRecord(step=3, uri="/store/job/step-00000003", world_size=1, final=True)],
    )
    _report(db, job_id, 4, state="SUCCEEDED", message="finished at step 3")
    exporter.run_once()
    exporter.run_once()  # a finished run is not exported twice

    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["ringmaster.state"] == "SUCCEEDED"
    assert run.data.tags["checkpoint.latest"] == "/store/job/step-00000003" == run.data.tags["checkpoint.step-00000003"]
    losses = [(metric.step, metric.value) for metric in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(losses) == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val_loss")] == [(3, 0.4)]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "grad_norm")) == [1, 2]
    accuracy = client.get_metric_history(run.info.run_id, "accuracy")  # the user's own metric, under its name
    assert sorted((m.step, m.value) for m in accuracy) == [(1, 0.25), (2, 0.5)]
    assert [m.timestamp for m in client.get_metric_history(run.info.run_id, "world_size")] == [
        int((now + step) * 1000) for step in (1, 2, 3)
    ]

    # A job that never ran (its driver could not start) ends its run FAILED, with the reason.
    failed = _job(db, "never-started", dispatcher)
    with session_scope(db.sessions) as session:
        job = session.get(Job, failed)
        jobs.transition(session, job, JobState.FAILED, "attempt 1: the job's driver never started: boom")
    exporter.run_once()
    [run] = [
        r
        for r in client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
        if r.info.run_name == "never-started"
    ]
    assert run.info.status == "FAILED" and "driver never started" in run.data.tags["ringmaster.error"]
