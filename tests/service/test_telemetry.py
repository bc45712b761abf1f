"""GET /metrics (exact sample values after driving jobs) and the job event stream (SSE), on both databases."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from itertools import chain
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from ringmaster.api.app import create_app
from ringmaster.service.db import Database, session_scope
from ringmaster.service.dispatcher import Dispatcher
from ringmaster.service.jobs import apply_driver_report, get_job, mark_admitted, transition
from ringmaster.service.models import DEFAULT_TENANT, JobEvent, utcnow
from ringmaster.service.reports import DriverReport
from ringmaster.service.settings import Settings
from ringmaster.service.states import JobState
from tests.service.test_dispatcher import FakeCluster
from tests.support.api_tokens import authorize, mint

SPEC = {
    "name": "observed",
    "model": "mlp",
    "workers": {"min": 1, "max": 2},
    "train": {"global_batch_size": 16, "micro_batch_size": 4},
}


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    app = create_app(Settings(database_url=db_url, data_dir=tmp_path))
    app.state.stream_poll_s = 0.05
    with TestClient(app) as test_client:
        authorize(test_client)
        yield test_client


def _db(client: TestClient) -> Database:
    app: FastAPI = client.app  # type: ignore[assignment]
    return app.state.db


def _submit(client: TestClient, name: str = "observed") -> str:
    response = client.post("/v1/jobs", json={**SPEC, "name": name})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _admit(client: TestClient, job_id: str, number: int = 1) -> None:
    with session_scope(_db(client).sessions) as session:
        mark_admitted(session, get_job(session, job_id), number, f"ringmaster-{job_id}-{number}", None, 2)


def _report(client: TestClient, job_id: str, attempt: int = 1, **body: Any) -> None:
    with session_scope(_db(client).sessions) as session:
        apply_driver_report(session, job_id, attempt, DriverReport.model_validate(body))


def _samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], metric: str, /, **labels: str) -> float:
    return samples[(metric, tuple(sorted(labels.items())))]


def test_metrics_count_queue_transitions_recoveries_and_running_jobs(client: TestClient) -> None:
    first = _submit(client, "first")
    second = _submit(client, "second")
    _submit(client, "third")
    _admit(client, first)
    _report(
        client, first, state="RUNNING", metrics=[{"step": 1, "loss": 2.0, "samples_per_s": 50.0, "step_time_s": 0.5}]
    )
    _report(client, first, state="RECOVERING", checkpoints=[{"step": 1, "uri": "file:///c/1", "world_size": 2}])
    _report(
        client,
        first,
        state="RUNNING",
        metrics=[{"step": 2, "loss": 1.5, "samples_per_s": 80.0, "step_time_s": 0.25}],
        checkpoints=[
            {"step": 1, "uri": "file:///c/1", "world_size": 2},
            {"step": 2, "uri": "file:///c/2", "world_size": 1},
        ],
    )
    client.post(f"/v1/jobs/{second}/cancel")

    samples = _samples(client)
    depth = {
        state.value: _value(samples, "ringmaster_jobs", state=state.value, tenant=DEFAULT_TENANT) for state in JobState
    }
    assert depth == {
        "QUEUED": 1,
        "ADMITTED": 0,
        "RUNNING": 1,
        "RECOVERING": 0,
        "SUCCEEDED": 0,
        "FAILED": 0,
        "CANCELLED": 1,
        "PREEMPTED": 0,
    }
    transitions = {
        state.value: _value(samples, "ringmaster_job_transitions_total", to_state=state.value) for state in JobState
    }
    assert transitions == {
        "QUEUED": 0,
        "ADMITTED": 1,
        "RUNNING": 2,
        "RECOVERING": 1,
        "SUCCEEDED": 0,
        "FAILED": 0,
        "CANCELLED": 1,
        "PREEMPTED": 0,
    }
    assert _value(samples, "ringmaster_recoveries_total") == 1
    assert _value(samples, "ringmaster_recovery_duration_seconds_count") == 1
    assert _value(samples, "ringmaster_dispatch_latency_seconds_count") == 1
    assert 0 <= _value(samples, "ringmaster_dispatch_latency_seconds_sum") < 60
    assert _value(samples, "ringmaster_checkpoints_total") == 2  # the replayed URI counts once
    running = {"job_id": first, "name": "first"}
    assert _value(samples, "ringmaster_job_step", **running) == 2
    assert _value(samples, "ringmaster_job_loss", **running) == 1.5
    assert _value(samples, "ringmaster_job_steps_per_second", **running) == 4.0
    assert _value(samples, "ringmaster_job_samples_per_second", **running) == 80.0
    assert not [key for key in samples if key[0] == "ringmaster_job_loss" and dict(key[1])["job_id"] != first]


def test_queue_depth_is_labelled_by_tenant(client: TestClient) -> None:
    _submit(client, "mine")
    client.headers["Authorization"] = f"Bearer {mint(client.app, 'team-b')}"  # type: ignore[arg-type]
    _submit(client, "theirs")
    _submit(client, "theirs-too")
    samples = _samples(client)
    assert _value(samples, "ringmaster_jobs", state="QUEUED", tenant=DEFAULT_TENANT) == 1
    assert _value(samples, "ringmaster_jobs", state="QUEUED", tenant="team-b") == 2
    assert _value(samples, "ringmaster_jobs", state="RUNNING", tenant="team-b") == 0


def test_checkpoint_save_and_restore_durations_are_observed_once(client: TestClient) -> None:
    job_id = _submit(client)
    _admit(client, job_id)
    saved = {"step": 10, "uri": "file:///c/10", "world_size": 2, "save_s": 0.8, "blocked_s": 0.02}
    _report(client, job_id, seq=1, state="RUNNING", checkpoints=[saved])
    _report(client, job_id, seq=2, checkpoints=[saved])  # the same checkpoint reported again: observed once
    _report(
        client,
        job_id,
        seq=3,
        message="restored checkpoint step 10 in 0.30s",
        details={"restored_step": 10, "restore_s": 0.3},
    )
    _report(
        client,
        job_id,
        seq=3,
        message="restored checkpoint step 10 in 0.30s",
        details={"restored_step": 10, "restore_s": 0.3},
    )
    samples = _samples(client)
    assert _value(samples, "ringmaster_checkpoint_save_seconds_count") == 1
    assert _value(samples, "ringmaster_checkpoint_save_seconds_sum") == pytest.approx(0.8)
    assert _value(samples, "ringmaster_checkpoint_blocked_seconds_sum") == pytest.approx(0.02)
    assert _value(samples, "ringmaster_checkpoint_restore_seconds_count") == 1  # the replayed report (seq 3) is skipped
    assert _value(samples, "ringmaster_checkpoint_restore_seconds_sum") == pytest.approx(0.3)
    restored = [
        e for e in client.get(f"/v1/jobs/{job_id}/events").json()["items"] if e["message"].startswith("restored")
    ]
    assert len(restored) == 1 and restored[0]["data"]["restore_s"] == 0.3


def test_reconciler_actions_are_counted(client: TestClient, tmp_path: Path) -> None:
    settings = Settings(database_url="unused", data_dir=tmp_path, api_url="http://control-plane")
    cluster = FakeCluster(cpus=8)
    started_here = Dispatcher(_db(client).sessions, cluster, settings)
    lost, kept = _submit(client, "lost"), _submit(client, "kept")
    started_here.run_once()  # admits both; watching its own jobs is no adoption
    for job_id in (lost, kept):
        _report(client, job_id, state="RUNNING")
    started_here.run_once()
    assert _value(_samples(client), "ringmaster_reconciler_actions_total", action="adopted") == 0

    cluster.ray_status.pop(f"ringmaster-{lost}-1")  # its Ray job vanished (the head restarted)
    other_replica = Dispatcher(_db(client).sessions, cluster, settings)
    other_replica.run_once()
    samples = _samples(client)
    assert _value(samples, "ringmaster_reconciler_actions_total", action="adopted") == 1  # kept
    assert _value(samples, "ringmaster_reconciler_actions_total", action="resubmitted") == 1  # lost
    assert _value(samples, "ringmaster_reconciler_actions_total", action="attempt_closed") == 1  # lost's first attempt
    assert client.get(f"/v1/jobs/{lost}").json()["attempt"] == 2
    assert client.get(f"/v1/jobs/{kept}").json()["attempt"] == 1


def test_rolled_back_transitions_count_nothing(client: TestClient) -> None:
    job_id = _submit(client)
    with pytest.raises(RuntimeError), session_scope(_db(client).sessions) as session:
        transition(session, get_job(session, job_id), JobState.FAILED, "doomed")
        raise RuntimeError("roll back")
    assert _value(_samples(client), "ringmaster_job_transitions_total", to_state="FAILED") == 0
    assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "QUEUED"


def _queued_ago(client: TestClient, job_id: str, seconds: float) -> None:
    """Make the job's last entry into QUEUED (its latest QUEUED event, and its creation) `seconds` ago: dispatch latency
    is counted from it, so the next admission's is known without waiting."""
    with session_scope(_db(client).sessions) as session:
        query = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.to_state == JobState.QUEUED)
        latest = session.scalars(query.order_by(JobEvent.id.desc()).limit(1)).one()
        latest.at = utcnow() - timedelta(seconds=seconds)
        job = get_job(session, job_id)
        job.created_at = min(job.created_at, latest.at)


def test_requeued_job_dispatch_latency_counts_from_its_requeue(client: TestClient) -> None:
    job_id = _submit(client)
    _queued_ago(client, job_id, 1000)  # submitted 1000 s ago
    _admit(client, job_id)
    with session_scope(_db(client).sessions) as session:
        transition(session, get_job(session, job_id), JobState.QUEUED, "lost")
    _queued_ago(client, job_id, 40)  # requeued 40 s ago
    _admit(client, job_id, number=2)
    samples = _samples(client)
    assert _value(samples, "ringmaster_dispatch_latency_seconds_count") == 2
    assert _value(samples, "ringmaster_job_transitions_total", to_state="QUEUED") == 1
    bucket = lambda le: _value(samples, "ringmaster_dispatch_latency_seconds_bucket", le=le)  # noqa: E731
    # The second admission waited 40 s, from its requeue (from the submission it would be over 1000 s); the first
    # 1000 s, from its submission. The buckets either side leave tens of seconds for the test's own run.
    assert [bucket("30.0"), bucket("60.0"), bucket("600.0"), bucket("1800.0")] == [0, 1, 1, 2]
    assert _value(samples, "ringmaster_dispatch_latency_seconds_sum") >= 1040


def test_apps_keep_their_own_registries(db_url: str, tmp_path: Path) -> None:
    with (
        TestClient(create_app(Settings(database_url=db_url, data_dir=tmp_path))) as one,
        TestClient(create_app(Settings(database_url=f"sqlite:///{tmp_path / 'other.db'}", data_dir=tmp_path))) as other,
    ):
        authorize(one)
        job_id = _submit(one)
        _admit(one, job_id)
        assert _value(_samples(one), "ringmaster_job_transitions_total", to_state="ADMITTED") == 1
        assert _value(_samples(other), "ringmaster_job_transitions_total", to_state="ADMITTED") == 0
        assert _value(_samples(other), "ringmaster_jobs", state="ADMITTED", tenant=DEFAULT_TENANT) == 0


def _parse_sse(text: str) -> list[dict[str, Any]]:
    messages = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if fields:
            messages.append({"id": fields["id"], "event": fields["event"], "data": json.loads(fields["data"])})
    return messages


class _Delivered:
    """The stream's messages as the test receives them. The driver writes each row once the stream has delivered the
    one before: the stream is seen sending while the job runs, not replaying it all once it ended."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.missed: list[str] = []
        self._changed = threading.Condition()

    def add(self, message: dict[str, Any]) -> None:
        with self._changed:
            self.messages.append(message)
            self._changed.notify_all()

    def wait_for(self, event: str, key: str, value: Any) -> None:
        """Until a message of this kind with data[key] == value came; on a timeout it notes the miss and returns, so
        the job still ends and with it the stream."""
        came = lambda: any(m["event"] == event and m["data"].get(key) == value for m in self.messages)  # noqa: E731
        with self._changed:
            if not self._changed.wait_for(came, timeout=30):
                self.missed.append(f"{event} with {key}={value}")


def _drive(client: TestClient, job_id: str, delivered: _Delivered | None = None) -> None:
    """Run the job to success in four writes, as its driver would. With `delivered` (a stream being read) each write
    waits until the stream sent the one before; without, the writes are a moment apart as a real job's are, and so are
    the timestamps that order a replay."""

    def after(pause_s: float, event: str, key: str, value: Any) -> None:
        if delivered is None:
            time.sleep(pause_s)
        else:
            delivered.wait_for(event, key, value)

    after(0.2, "state", "to_state", "QUEUED")  # a stream is open and sent what was there
    _admit(client, job_id)
    after(0.1, "state", "to_state", "ADMITTED")
    _report(client, job_id, state="RUNNING", metrics=[{"step": 1, "loss": 2.0}])
    after(0.1, "metric", "step", 1)
    _report(
        client,
        job_id,
        metrics=[{"step": 2, "loss": 1.0}],
        checkpoints=[{"step": 2, "uri": "file:///c/2", "world_size": 2}],
    )
    after(0.1, "event", "kind", "checkpoint")
    _report(client, job_id, state="SUCCEEDED", metrics=[{"step": 3, "loss": 0.5}])


def test_stream_sends_states_metrics_and_events_until_the_job_ends(client: TestClient) -> None:
    job_id = _submit(client)
    delivered = _Delivered()
    driver = threading.Thread(target=_drive, args=(client, job_id, delivered))
    driver.start()
    with client.stream("GET", f"/v1/jobs/{job_id}/stream") as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        block: list[str] = []
        for line in chain(response.iter_lines(), [""]):  # each message as it comes (a blank line ends one)
            if line:
                block.append(line)
                continue
            for message in _parse_sse("\n".join(block)):
                delivered.add(message)
            block = []
    driver.join()
    assert delivered.missed == [], "the stream did not send these while the job ran"
    messages = delivered.messages
    states = [m["data"]["to_state"] for m in messages if m["event"] == "state"]
    assert states == ["QUEUED", "ADMITTED", "RUNNING", "SUCCEEDED"]
    assert [
        (m["data"]["attempt"], m["data"]["step"], m["data"]["loss"]) for m in messages if m["event"] == "metric"
    ] == [(1, 1, 2.0), (1, 2, 1.0), (1, 3, 0.5)]
    assert [m["data"]["kind"] for m in messages if m["event"] == "event"] == ["checkpoint"]
    # The stream ended by itself, once the job ended and all was sent (a stream that never ends meets pytest's timeout).
    assert (messages[-1]["event"], messages[-1]["data"]["to_state"]) == ("state", "SUCCEEDED")

    # Resuming from any message's id sends exactly the messages that followed it (all at once: the job is over).
    for index in (0, len(messages) // 2, len(messages) - 1):
        response = client.get(f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": messages[index]["id"]})
        resumed = _parse_sse(response.text)
        key = lambda m: (m["event"], json.dumps(m["data"], sort_keys=True))  # noqa: E731
        assert sorted(map(key, resumed)) == sorted(map(key, messages[index + 1 :]))
    assert _parse_sse(client.get(f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": "garbage"}).text) != []


def _label(message: dict[str, Any]) -> str:
    data = message["data"]
    return {"state": lambda: data["to_state"], "metric": lambda: f"step {data['step']}", "event": lambda: data["kind"]}[
        message["event"]
    ]()


def test_a_finished_jobs_stream_replays_in_the_order_things_happened_and_ends_with_its_end(client: TestClient) -> None:
    job_id = _submit(client)
    _drive(client, job_id)

    messages = _parse_sse(client.get(f"/v1/jobs/{job_id}/stream").text)

    # A report stores its metric rows before the state it brings; the checkpoint it reports after them.
    assert [_label(m) for m in messages] == [
        "QUEUED",
        "ADMITTED",
        "step 1",
        "RUNNING",
        "step 2",
        "checkpoint",
        "step 3",
        "SUCCEEDED",
    ]


def test_a_stream_read_in_short_batches_sends_the_jobs_end_after_every_metric(client: TestClient) -> None:
    from ringmaster.service.event_stream import Cursor, read_batch

    job_id = _submit(client)
    _admit(client, job_id)
    _report(client, job_id, state="RUNNING")
    _report(client, job_id, state="SUCCEEDED", metrics=[{"step": step, "loss": 1.0 / step} for step in range(1, 8)])
    cursor, sent, finished = Cursor(), [], False
    while not finished:
        with _db(client).sessions() as session:
            batch = read_batch(session, job_id, cursor, limit=3)
        sent += [(item.type, item.data.get("to_state") or item.data.get("step")) for item in batch.items]
        cursor, finished = batch.cursor, batch.finished

    assert sent[-1] == ("state", "SUCCEEDED")
    assert [value for kind, value in sent if kind == "metric"] == list(range(1, 8))
    assert [value for kind, value in sent if kind == "state"] == ["QUEUED", "ADMITTED", "RUNNING", "SUCCEEDED"]


def test_stream_of_unknown_job_is_404(client: TestClient) -> None:
    assert client.get("/v1/jobs/nope/stream").status_code == 404


def test_client_stream_and_watch_progress(client: TestClient) -> None:
    from ringmaster.cli.jobs import _progress
    from ringmaster.service.client import ApiError, RingmasterClient

    job_id = _submit(client)
    _drive(client, job_id)
    api = RingmasterClient("http://testserver")
    api._http = client  # the TestClient is an HTTP client on the app (httpx2's where installed: starlette prefers it)
    messages = list(api.stream(job_id))
    assert [m["data"]["to_state"] for m in messages if m["event"] == "state"] == [
        "QUEUED",
        "ADMITTED",
        "RUNNING",
        "SUCCEEDED",
    ]
    assert list(api.stream(job_id, last_event_id=messages[-1]["id"])) == []
    progress = list(_progress(api, job_id))
    assert [state for state, _ in progress if state] == ["QUEUED", "ADMITTED", "RUNNING", "SUCCEEDED"]
    assert [row["step"] for _, rows in progress for row in rows] == [1, 2, 3]
    with pytest.raises(ApiError):
        list(api.stream("nope"))


def test_json_logs_carry_the_job_id(client: TestClient) -> None:
    import io
    import logging

    from ringmaster.service.logs import JsonFormatter

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("ringmaster.service.jobs")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        job_id = _submit(client)
        _admit(client, job_id)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    admitted = [r for r in records if r.get("to_state") == "ADMITTED"]
    assert len(admitted) == 1 and admitted[0]["job_id"] == job_id and admitted[0]["level"] == "INFO"
    assert (
        admitted[0]["logger"] == "ringmaster.service.jobs"
        and job_id in admitted[0]["message"]
        and admitted[0]["ts"].endswith("Z")
    )
