"""The REST API end to end on a real database: status codes, bodies, and nothing written on rejection."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from ringmaster.api.app import create_app
from ringmaster.service import auth
from ringmaster.service.auth import new_report_token
from ringmaster.service.db import Database, session_scope
from ringmaster.service.errors import LogsUnavailable
from ringmaster.service.jobs import get_job, mark_admitted, requeue
from ringmaster.service.settings import Settings
from tests.support.api_tokens import authorize, table_rows

DASHBOARD = "http://ray-head:8265"
SPEC = {
    "name": "mnist-ish",
    "model": "mlp",
    "workers": {"min": 1, "max": 2},
    "train": {"global_batch_size": 16, "micro_batch_size": 4},
}


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(database_url=db_url, data_dir=tmp_path, ray_dashboard_url=DASHBOARD + "/")
    with TestClient(create_app(settings)) as test_client:
        authorize(test_client)
        yield test_client


def _db(client: TestClient) -> Database:
    app: FastAPI = client.app  # type: ignore[assignment]
    return app.state.db


def _submit(client: TestClient, **overrides: Any) -> dict[str, Any]:
    response = client.post("/v1/jobs", json={**SPEC, **overrides})
    assert response.status_code == 201, response.text
    return response.json()


_report_tokens: dict[tuple[str, int], str] = {}  # (job id, attempt) -> the secret its driver would hold


def _admit(client: TestClient, job_id: str, number: int = 1) -> str:
    submission_id = f"ringmaster-{job_id}-{number}"
    secret, secret_hash = new_report_token()
    with session_scope(_db(client).sessions) as session:
        mark_admitted(
            session, get_job(session, job_id), number, submission_id, f"pg-{job_id}", 2, report_token_hash=secret_hash
        )
    _report_tokens[(job_id, number)] = secret
    return submission_id


def _report(client: TestClient, job_id: str, body: dict[str, Any], attempt: int = 1) -> Any:
    token = _report_tokens.get((job_id, attempt), "no-such-token")
    return client.post(
        f"/v1/internal/jobs/{job_id}/attempts/{attempt}/report", json=body, headers={"Authorization": f"Bearer {token}"}
    )


def _total_jobs(client: TestClient) -> int:
    return client.get("/v1/jobs").json()["total"]


def test_submit_json_returns_the_queued_job(client: TestClient) -> None:
    job = _submit(client, priority=7)
    assert job["state"] == "QUEUED" and job["attempt"] == 0 and job["priority"] == 7
    defaults = {"min": 1, "max": 2, "gpus_per_worker": 0, "cpus_per_worker": 1.0, "gpu_memory_gb": None}
    assert job["spec"]["data"] == "synthetic" and job["spec"]["workers"].items() >= defaults.items()
    assert job["tenant"] == "default" and job["waiting_reason"] is None
    assert job["ray_job_id"] is None and job["dashboard_url"] is None
    assert job["created_at"].endswith("Z") and job["started_at"] is None
    assert client.get(f"/v1/jobs/{job['id']}").json() == job


def test_submit_yaml_body(client: TestClient) -> None:
    text = "name: from-yaml\nmodel: tiny-gpt\ntrain:\n  steps: 5\n"
    response = client.post("/v1/jobs", content=text, headers={"Content-Type": "application/yaml"})
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["train"]["steps"] == 5 and response.json()["spec"]["data"] == "pysource"


@pytest.mark.parametrize(
    ("body", "content_type", "field", "message"),
    [
        (
            {**SPEC, "workers": {"min": 3, "max": 2}},
            "json",
            "workers.min",
            "workers.min (3) must not exceed workers.max (2)",
        ),
        ({**SPEC, "optimizer": "adam"}, "json", "optimizer", "Extra inputs are not permitted"),
        ({**SPEC, "model": "resnet"}, "json", "model", "got 'resnet'"),
        ({**SPEC, "name": "Bad Name"}, "json", "name", "must be 1-64 characters"),
        ({**SPEC, "train": {"global_batch_size": 6}}, "json", "train.global_batch_size", "train.global_batch_size (6)"),
        ("name: x\nmodel: mlp\nworkers: {min: 0}\n", "yaml", "workers.min", "greater than or equal to 1"),
        ("name: [unclosed\n", "yaml", "body", "not a YAML job spec"),
        ("{not json", "json", "body", "Invalid JSON"),
    ],
)
def test_invalid_spec_is_422_naming_the_field_and_writes_nothing(
    client: TestClient, body: Any, content_type: str, field: str, message: str
) -> None:
    before = table_rows(client.app)
    headers = {"Content-Type": f"application/{content_type}"}
    if isinstance(body, dict):
        response = client.post("/v1/jobs", json=body, headers=headers)
    else:
        response = client.post("/v1/jobs", content=body, headers=headers)
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["field"] == field and error["loc"][0] == "body"
    assert message in error["msg"] and not error["msg"].startswith("Value error")
    assert table_rows(client.app) == before


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        (
            {"train": {"micro_batch_sz": 4}},
            "train.micro_batch_sz",
            "Extra inputs are not permitted: did you mean 'micro_batch_size'?",
        ),
        (
            {"data": {"kind": "tokens", "path": "/data/t.bin", "seq_len": 8, "dtyp": "uint16"}},
            "data.tokens.dtyp",
            "Extra inputs are not permitted: did you mean 'dtype'?",
        ),
        ({"workers": {"min": 1, "max": 1, "colour": "red"}}, "workers.colour", "Extra inputs are not permitted"),
    ],
)
def test_a_misspelt_field_is_answered_with_the_field_of_that_place_it_is_closest_to(
    client: TestClient, fields: dict[str, Any], field: str, message: str
) -> None:
    response = client.post("/v1/jobs", json={**SPEC, **fields})
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert (error["field"], error["msg"]) == (field, message)


def test_unsupported_content_type_is_415(client: TestClient) -> None:
    response = client.post("/v1/jobs", content="name=x", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert response.status_code == 415
    assert _total_jobs(client) == 0


def test_list_filters_by_state_and_pages_newest_first(client: TestClient) -> None:
    ids = [_submit(client, name=f"job-{i}")["id"] for i in range(3)]
    client.post(f"/v1/jobs/{ids[0]}/cancel")
    page = client.get("/v1/jobs", params={"limit": 2}).json()
    assert (page["total"], page["limit"], page["offset"]) == (3, 2, 0)
    assert [job["id"] for job in page["items"]] == [ids[2], ids[1]]
    assert [job["id"] for job in client.get("/v1/jobs", params={"limit": 2, "offset": 2}).json()["items"]] == [ids[0]]
    queued = client.get("/v1/jobs", params={"state": "QUEUED"}).json()
    assert queued["total"] == 2 and {job["id"] for job in queued["items"]} == set(ids[1:])
    assert [job["id"] for job in client.get("/v1/jobs", params={"state": "CANCELLED"}).json()["items"]] == [ids[0]]


@pytest.mark.parametrize(
    ("params", "field"),
    [({"state": "sleeping"}, "state"), ({"limit": 0}, "limit"), ({"limit": 501}, "limit"), ({"offset": -1}, "offset")],
)
def test_list_rejects_bad_query_parameters(client: TestClient, params: dict[str, Any], field: str) -> None:
    response = client.get("/v1/jobs", params=params)
    assert response.status_code == 422
    assert [error["field"] for error in response.json()["detail"]] == [field]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", ""),
        ("post", "/cancel"),
        ("get", "/events"),
        ("get", "/metrics"),
        ("get", "/checkpoints"),
        ("get", "/logs"),
    ],
)
def test_unknown_job_is_404(client: TestClient, method: str, path: str) -> None:
    response = client.request(method, f"/v1/jobs/0123456789abcdef{path}")
    assert response.status_code == 404
    assert "0123456789abcdef" in response.json()["detail"]


def test_report_without_its_attempts_secret_is_401(client: TestClient) -> None:
    assert _report(client, "nope", {"state": "RUNNING"}).status_code == 401
    job_id = _submit(client)["id"]
    _admit(client, job_id)
    url = f"/v1/internal/jobs/{job_id}/attempts/1/report"
    user_token = client.post(url, json={"state": "RUNNING"})  # the client's admin token is not a report token
    missing = client.post(url, json={"state": "RUNNING"}, headers={"Authorization": ""})
    assert (user_token.status_code, missing.status_code) == (401, 401)
    assert user_token.headers["www-authenticate"].startswith("Bearer")
    assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "ADMITTED"


def test_one_attempts_secret_cannot_report_for_another(client: TestClient) -> None:
    first, second = _submit(client)["id"], _submit(client)["id"]
    _admit(client, first)
    _admit(client, second)
    forged = client.post(
        f"/v1/internal/jobs/{second}/attempts/1/report",
        json={"state": "RUNNING"},
        headers={"Authorization": f"Bearer {_report_tokens[(first, 1)]}"},
    )
    assert forged.status_code == 401 and "attempt 1 of job" in forged.json()["detail"]
    assert client.get(f"/v1/jobs/{second}").json()["state"] == "ADMITTED"


def test_a_report_token_found_good_is_looked_up_once_and_a_wrong_one_is_refused_after_it(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = _submit(client)["id"]
    _admit(client, job_id)
    lookups: list[str | None] = []
    look_up = auth.check_report_token

    def counted(session: Any, job: str, attempt: int, secret: str | None) -> None:
        lookups.append(secret)
        look_up(session, job, attempt, secret)

    monkeypatch.setattr(auth, "check_report_token", counted)
    for step in (1, 2, 3):
        assert (
            _report(
                client, job_id, {"seq": step, "state": "RUNNING", "metrics": [{"step": step, "loss": 1.0}]}
            ).status_code
            == 200
        )
    wrong = new_report_token()[0]
    for seq in (4, 5):
        forged = client.post(
            f"/v1/internal/jobs/{job_id}/attempts/1/report",
            json={"seq": seq, "metrics": [{"step": seq, "loss": 9.0}]},
            headers={"Authorization": f"Bearer {wrong}"},
        )
        assert forged.status_code == 401
    # The first report's token was looked up and the next two were not; the wrong secret each time, never taken as good.
    assert lookups == [_report_tokens[(job_id, 1)], wrong, wrong]
    assert [row["step"] for row in client.get(f"/v1/jobs/{job_id}/metrics").json()["items"]] == [1, 2, 3]


def test_cancel_queued_job_then_cancel_again_is_409(client: TestClient) -> None:
    job_id = _submit(client)["id"]
    cancelled = client.post(f"/v1/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["state"] == "CANCELLED" and cancelled.json()["finished_at"] is not None
    again = client.post(f"/v1/jobs/{job_id}/cancel")
    assert again.status_code == 409 and "CANCELLED" in again.json()["detail"]
    events = client.get(f"/v1/jobs/{job_id}/events").json()
    assert [(e["from_state"], e["to_state"]) for e in events["items"]] == [(None, "QUEUED"), ("QUEUED", "CANCELLED")]


def test_admitted_job_shows_ray_job_and_dashboard_link(client: TestClient) -> None:
    job_id = _submit(client)["id"]
    submission_id = _admit(client, job_id)
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert (job["state"], job["attempt"], job["ray_job_id"]) == ("ADMITTED", 1, submission_id)
    assert job["dashboard_url"] == f"{DASHBOARD}/#/jobs/{submission_id}"


def test_driver_reports_run_the_job_to_success(client: TestClient) -> None:
    job_id = _submit(client)["id"]
    _admit(client, job_id)
    running = _report(client, job_id, {"state": "RUNNING", "message": "2 workers up"})
    assert running.json() == {"state": "RUNNING", "accepted": True, "preempting": False, "preempted_for": None}
    assert client.get(f"/v1/jobs/{job_id}").json()["started_at"] is not None
    done = _report(
        client,
        job_id,
        {"state": "SUCCEEDED", "checkpoints": [{"step": 9, "uri": "file:///c/9", "world_size": 2, "final": True}]},
    )
    assert done.json() == {"state": "SUCCEEDED", "accepted": True, "preempting": False, "preempted_for": None}
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["finished_at"] is not None and job["error"] is None
    kinds = [(e["kind"], e["to_state"]) for e in client.get(f"/v1/jobs/{job_id}/events").json()["items"]]
    assert kinds == [
        ("transition", "QUEUED"),
        ("transition", "ADMITTED"),
        ("transition", "RUNNING"),
        ("checkpoint", None),
        ("transition", "SUCCEEDED"),
    ]


def test_failed_report_stores_the_reason(client: TestClient) -> None:
    job_id = _submit(client)["id"]
    _admit(client, job_id)
    _report(client, job_id, {"state": "RUNNING"})
    assert _report(client, job_id, {"state": "FAILED", "message": "CUDA OOM on rank 1"}).json()["state"] == "FAILED"
    assert client.get(f"/v1/jobs/{job_id}").json()["error"] == "CUDA OOM on rank 1"
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 409


def test_replayed_report_stores_one_row_per_step_and_checkpoint(client: TestClient) -> None:
    job_id = _submit(client)["id"]
    _admit(client, job_id)
    report = {
        "state": "RUNNING",
        "metrics": [{"step": step, "loss": 2.0 / step, "samples_per_s": 100.0, "world_size": 2} for step in (1, 2, 3)],
        "checkpoints": [{"step": 3, "uri": "file:///ckpt/3", "world_size": 2}],
    }
    for _ in range(2):
        assert _report(client, job_id, report).json() == {
            "state": "RUNNING",
            "accepted": True,
            "preempting": False,
            "preempted_for": None,
        }
    metrics = client.get(f"/v1/jobs/{job_id}/metrics").json()
    assert metrics["total"] == 3 and [(m["attempt"], m["step"], m["loss"]) for m in metrics["items"]] == [
        (1, 1, 2.0),
        (1, 2, 1.0),
        (1, 3, 2.0 / 3),
    ]
    checkpoints = client.get(f"/v1/jobs/{job_id}/checkpoints").json()
    assert [(c["step"], c["uri"], c["final"]) for c in checkpoints["items"]] == [(3, "file:///ckpt/3", False)]
    events = client.get(f"/v1/jobs/{job_id}/events").json()["items"]
    assert [e["kind"] for e in events].count("checkpoint") == 1
    assert [e["to_state"] for e in events].count("RUNNING") == 1


def test_later_report_merges_val_loss_into_the_existing_step(client: TestClient) -> None:
    job_id = _submit(client)["id"]
    _admit(client, job_id)
    _report(client, job_id, {"state": "RUNNING", "metrics": [{"step": 10, "loss": 0.5, "lr": 0.001}]})
    _report(client, job_id, {"metrics": [{"step": 10, "val_loss": 0.7}, {"step": 11, "loss": 0.4}]})
    rows = client.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
    assert [(m["step"], m["loss"], m["val_loss"], m["lr"]) for m in rows] == [
        (10, 0.5, 0.7, 0.001),
        (11, 0.4, None, None),
    ]


def test_user_metrics_come_back_from_metrics_and_a_later_point_of_the_step_keeps_them(client: TestClient) -> None:
    job_id = _submit(client)["id"]
    _admit(client, job_id)
    user_metrics = {"accuracy": 0.75, "top-5/accuracy": 1}
    _report(client, job_id, {"state": "RUNNING", "metrics": [{"step": 3, "loss": 0.5, "user_metrics": user_metrics}]})
    _report(client, job_id, {"metrics": [{"step": 3, "val_loss": 0.7}, {"step": 4, "loss": 0.4}]})
    rows = client.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
    assert [(m["step"], m["val_loss"], m["user_metrics"]) for m in rows] == [
        (3, 0.7, {"accuracy": 0.75, "top-5/accuracy": 1.0}),
        (4, None, None),
    ]
    refused = _report(client, job_id, {"metrics": [{"step": 5, "loss": 0.3, "user_metrics": {"top 5": 1.0}}]})
    assert refused.status_code == 422, refused.text
    assert [error["field"] for error in refused.json()["detail"]] == ["metrics.0.user_metrics.top 5.[key]"]


def test_a_step_reported_twice_in_one_report_is_one_row_with_both_points_values(client: TestClient) -> None:
    # A validated step's training point and its val_loss point travel in the same report.
    job_id = _submit(client)["id"]
    _admit(client, job_id)
    _report(
        client,
        job_id,
        {
            "state": "RUNNING",
            "metrics": [{"step": 5, "loss": 0.5, "lr": 0.001}, {"step": 5, "val_loss": 0.6}, {"step": 6, "loss": 0.4}],
        },
    )
    rows = client.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
    assert [(m["step"], m["loss"], m["val_loss"], m["lr"]) for m in rows] == [
        (5, 0.5, 0.6, 0.001),
        (6, 0.4, None, None),
    ]


def test_replayed_points_of_an_earlier_attempt_are_stored_as_that_attempts(client: TestClient) -> None:
    job_id = _submit(client)["id"]
    _admit(client, job_id, number=1)
    _report(client, job_id, {"state": "RUNNING", "metrics": [{"step": 1, "loss": 1.0}]})
    with session_scope(_db(client).sessions) as session:
        requeue(session, get_job(session, job_id), "driver lost")
    _admit(client, job_id, number=2)
    # Attempt 2 resumed from attempt 1's checkpoint at step 2 and replays what it kept: step 1 again, and step 2,
    # which attempt 1 never reported; then its own step 3.
    replay = [{"step": 1, "loss": 1.0, "attempt": 1}, {"step": 2, "loss": 0.9, "attempt": 1}, {"step": 3, "loss": 0.8}]
    for _ in range(2):
        assert _report(client, job_id, {"state": "RUNNING", "metrics": replay}, attempt=2).json()["accepted"]
    rows = client.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
    assert [(m["attempt"], m["step"], m["loss"]) for m in rows] == [(1, 1, 1.0), (1, 2, 0.9), (2, 3, 0.8)]

    future = _report(
        client, job_id, {"metrics": [{"step": 4, "loss": 0.7}, {"step": 4, "loss": 0.7, "attempt": 3}]}, attempt=2
    )
    assert future.status_code == 422, future.text
    [error] = future.json()["detail"]
    assert (error["field"], error["msg"], error["input"]) == (
        "metrics.1.attempt",
        "must be at most the reporting attempt (2)",
        3,
    )
    assert client.get(f"/v1/jobs/{job_id}/metrics").json()["total"] == 3, "a refused report stored nothing"


def test_reports_from_stale_attempts_or_finished_jobs_are_ignored(client: TestClient) -> None:
    job_id = _submit(client)["id"]
    _admit(client, job_id, number=1)
    with session_scope(_db(client).sessions) as session:
        requeue(session, get_job(session, job_id), "driver lost")
    _admit(client, job_id, number=2)
    stale = _report(client, job_id, {"state": "RUNNING", "metrics": [{"step": 1, "loss": 1.0}]}, attempt=1)
    assert stale.json() == {"state": "ADMITTED", "accepted": False, "preempting": False, "preempted_for": None}
    client.post(f"/v1/jobs/{job_id}/cancel")
    late = _report(
        client,
        job_id,
        {"metrics": [{"step": 2, "loss": 1.0}], "checkpoints": [{"step": 2, "uri": "u", "world_size": 1}]},
        attempt=2,
    )
    assert late.json() == {"state": "CANCELLED", "accepted": False, "preempting": False, "preempted_for": None}
    assert client.get(f"/v1/jobs/{job_id}/metrics").json()["total"] == 0
    assert client.get(f"/v1/jobs/{job_id}/checkpoints").json()["total"] == 0


def test_illegal_report_is_409_and_writes_nothing(client: TestClient) -> None:
    job_id = _submit(client)["id"]
    _admit(client, job_id)
    response = _report(client, job_id, {"state": "SUCCEEDED", "metrics": [{"step": 1, "loss": 1.0}]})
    assert response.status_code == 409
    assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "ADMITTED"
    assert client.get(f"/v1/jobs/{job_id}/metrics").json()["total"] == 0


def test_report_with_unknown_field_is_422(client: TestClient) -> None:
    job_id = _submit(client)["id"]
    _admit(client, job_id)
    response = _report(client, job_id, {"state": "RUNNING", "gpu_temp": 80})
    assert response.status_code == 422
    assert [error["field"] for error in response.json()["detail"]] == ["gpu_temp"]
    assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "ADMITTED"


def test_logs_need_a_provider_and_a_dispatched_job(client: TestClient) -> None:
    job_id = _submit(client)["id"]
    unconfigured = client.get(f"/v1/jobs/{job_id}/logs")
    assert unconfigured.status_code == 503 and "logs provider" in unconfigured.json()["detail"]
    asked: list[str] = []

    def provider(submission_id: str) -> str:
        asked.append(submission_id)
        return f"log of {submission_id}\n"

    client.app.state.logs_provider = provider  # type: ignore[attr-defined]
    assert client.get(f"/v1/jobs/{job_id}/logs").status_code == 409
    submission_id = _admit(client, job_id)
    response = client.get(f"/v1/jobs/{job_id}/logs")
    assert response.status_code == 200 and response.text == f"log of {submission_id}\n"
    assert asked == [submission_id]


def test_logs_provider_errors_are_503(client: TestClient) -> None:
    job_id = _submit(client)["id"]
    _admit(client, job_id)

    def unreachable(submission_id: str) -> str:
        raise LogsUnavailable(f"Ray dashboard unreachable for {submission_id}")

    client.app.state.logs_provider = unreachable  # type: ignore[attr-defined]
    response = client.get(f"/v1/jobs/{job_id}/logs")
    assert response.status_code == 503 and "unreachable" in response.json()["detail"]


def test_healthz_checks_the_database(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "database": "ok"}
    state = client.app.state  # type: ignore[attr-defined]
    working, state.db = state.db, Database.connect("postgresql+psycopg://nobody@127.0.0.1:1/nowhere")
    try:
        response = client.get("/healthz")
    finally:
        state.db.dispose()
        state.db = working
    assert response.status_code == 503 and response.json()["status"] == "unavailable"


def test_background_hook_starts_after_schema_and_stops_on_shutdown(db_url: str, tmp_path: Path) -> None:
    calls: list[str] = []

    def start(app: FastAPI) -> Any:
        with session_scope(app.state.db.sessions) as session:
            calls.append(f"tables ready: {session.connection().exec_driver_sql('SELECT count(*) FROM jobs').scalar()}")
        return lambda: calls.append("stopped")

    with TestClient(
        create_app(Settings(database_url=db_url, data_dir=tmp_path), start_background=start)
    ) as test_client:
        assert test_client.get("/healthz").status_code == 200
        assert calls == ["tables ready: 0"]
    assert calls == ["tables ready: 0", "stopped"]


def test_openapi_documents_the_job_spec_body(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    body = schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/yaml"}
    assert "workers" in schema["components"]["schemas"]["JobSpec"]["properties"]
    assert "WorkersSpec" in schema["components"]["schemas"]


def test_database_outage_is_503_with_retry_after_not_a_500(client: TestClient) -> None:
    app: FastAPI = client.app  # type: ignore[assignment]
    working = app.state.db
    app.state.db = Database.connect("postgresql+psycopg://ringmaster:ringmaster@127.0.0.1:1/gone?connect_timeout=2")
    try:
        response = client.get("/v1/jobs")
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1" and "database is unavailable" in response.json()["detail"]
    finally:
        app.state.db.dispose()
        app.state.db = working
    assert client.get("/v1/jobs").status_code == 200
