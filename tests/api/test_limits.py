"""Input that must not reach a 500: oversized bodies (413), and specs too deep, too large, or with numbers no
database or JSON can hold (422, with nothing written); on both databases."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ringmaster.api.app import create_app
from ringmaster.api.limits import MAX_DEPTH, MAX_VALUES
from ringmaster.service.auth import new_report_token
from ringmaster.service.db import session_scope
from ringmaster.service.jobs import get_job, mark_admitted
from ringmaster.service.settings import Settings
from tests.support.api_tokens import authorize, table_rows

LIMIT = 64 * 1024
SPEC = {
    "name": "limited",
    "model": "mlp",
    "workers": {"min": 1, "max": 1},
    "train": {"global_batch_size": 4, "micro_batch_size": 4},
}


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(
        create_app(Settings(database_url=db_url, data_dir=tmp_path, max_request_bytes=LIMIT))
    ) as test_client:
        authorize(test_client)
        yield test_client


def _jobs(client: TestClient) -> int:
    return client.get("/v1/jobs").json()["total"]


def _rejected(client: TestClient, body: bytes | str, content_type: str = "application/json") -> dict[str, Any]:
    before = table_rows(client.app)
    response = client.post("/v1/jobs", content=body, headers={"Content-Type": content_type})
    assert response.status_code == 422, response.text
    assert table_rows(client.app) == before
    [error] = response.json()["detail"]
    return error


def test_body_over_the_limit_is_413_before_it_is_read(client: TestClient) -> None:
    body = json.dumps({**SPEC, "model_options": {"padding": "x" * LIMIT}})
    response = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and f"limit of {LIMIT} bytes" in response.json()["detail"]
    assert _jobs(client) == 0


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/plan"])
def test_streamed_body_without_a_length_is_cut_off_at_the_limit(client: TestClient, path: str) -> None:
    sent: list[int] = []

    def chunks() -> Iterator[bytes]:
        yield b'{"model_options": {"padding": "'
        for _ in range(64):
            sent.append(1)
            yield b"x" * 4096
        yield b'"}}'

    response = client.post(path, content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "RINGMASTER_MAX_REQUEST_BYTES" in response.json()["detail"]
    assert _jobs(client) == 0


def test_yaml_nested_too_deep_is_422(client: TestClient) -> None:
    deep = "model_options: " + "[" * 5000 + "]" * 5000 + "\n"
    error = _rejected(client, f"name: deep\nmodel: mlp\n{deep}", "application/yaml")
    assert f"deeper than {MAX_DEPTH} levels" in error["msg"]


def test_yaml_alias_expansion_is_bounded(client: TestClient) -> None:
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    text = "name: bomb\nmodel: mlp\nmodel_options:\n" + "".join(f"  {line}\n" for line in levels)
    error = _rejected(client, text, "application/yaml")
    assert f"more than {MAX_VALUES} values" in error["msg"]


def test_yaml_merge_keys_are_refused(client: TestClient) -> None:
    text = "name: merged\nmodel: mlp\nbase: &base {n_layers: 2}\nmodel_options:\n  <<: *base\n"
    assert "merge keys" in _rejected(client, text, "application/yaml")["msg"]


@pytest.mark.parametrize(
    ("body", "content_type", "needle", "field"),
    [
        (
            '{"name": "x", "model": "mlp", "train": {"lr": NaN}}',
            "application/json",
            "NaN is not a JSON number",
            "train.lr",
        ),
        (
            '{"name": "x", "model": "mlp", "train": {"weight_decay": 1e999}}',
            "application/json",
            "not a finite number",
            "train.weight_decay",
        ),
        (
            "name: x\nmodel: mlp\ntrain: {weight_decay: .inf}\n",
            "application/yaml",
            "not a finite number",
            "train.weight_decay",
        ),
        (
            '{"name": "x", "model": "mlp", "model_options": {"n": 1' + "0" * 30 + "}}",
            "application/json",
            "does not fit in 64",
            "model_options.n",
        ),
        (
            '{"name": "x", "model": "mlp", "model_options": {"n": 1' + "0" * 5000 + "}}",
            "application/json",
            "Invalid JSON",
            "body",
        ),
        ("[" * 50_000, "application/json", "Invalid JSON", "body"),
        (b'{"name": "\xff\xfe"}', "application/json", "Invalid JSON", "body"),
        (b"name: \xff\xfe\n", "application/yaml", "not UTF-8", "body"),
        (
            "name: x\nmodel: mlp\nmodel_options: {when: 2024-01-01}\n",
            "application/yaml",
            "type date is not accepted",
            "model_options.when",
        ),
        ("- just\n- a list\n", "application/yaml", "must be a mapping", "body"),
    ],
)
def test_unstorable_spec_is_422_naming_what_is_wrong(
    client: TestClient, body: str | bytes, content_type: str, needle: str, field: str
) -> None:
    error = _rejected(client, body, content_type)
    assert needle in error["msg"] and error["field"] == field


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"parameters": 10**30, "gpu_memory_gb": 80}, "parameters"),
        ({"parameters": 10**9, "gpu_memory_gb": 80, "layers": 10**12, "hidden": 8, "heads": 1, "seq_len": 8}, "layers"),
        ({"model": "tiny-gpt", "model_options": {"n_layers": 10**40}, "gpu_memory_gb": 80}, "model_options"),
    ],
)
def test_plan_with_out_of_range_numbers_is_422(client: TestClient, body: dict[str, Any], field: str) -> None:
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["field"] == field


def test_plan_with_nan_in_model_options_is_422(client: TestClient) -> None:
    response = client.post(
        "/v1/plan",
        content='{"model": "tiny-gpt", "model_options": {"dim": NaN}, "gpu_memory_gb": 80}',
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 422 and "not a finite number" in response.text


def test_paging_past_any_database_integer_is_422(client: TestClient) -> None:
    response = client.get("/v1/jobs", params={"offset": 10**20})
    assert response.status_code == 422 and response.json()["detail"][0]["field"] == "offset"


@pytest.mark.parametrize("job_id", ["a%00b", "x" * 5000, "ü" * 10, "..%2F", "%FF%FE"])
def test_implausible_job_ids_are_404(client: TestClient, job_id: str) -> None:
    response = client.get(f"/v1/jobs/{job_id}")
    assert response.status_code == 404


def test_stream_resumes_from_the_start_after_an_unusable_last_event_id(client: TestClient) -> None:
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    client.post(f"/v1/jobs/{job_id}/cancel")
    response = client.get(f"/v1/jobs/{job_id}/stream", headers={"Last-Event-ID": f"{10**30}:{10**30}:{10**30}"})
    assert response.status_code == 200 and "event: state" in response.text


def test_driver_report_with_unstorable_values_is_422_and_changes_nothing(client: TestClient) -> None:
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    secret, secret_hash = new_report_token()
    with session_scope(client.app.state.db.sessions) as session:  # type: ignore[attr-defined]
        mark_admitted(
            session, get_job(session, job_id), 1, f"ringmaster-{job_id}-1", None, 1, report_token_hash=secret_hash
        )
    url = f"/v1/internal/jobs/{job_id}/attempts/1/report"
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    for body in (
        '{"state": "RUNNING", "details": {"x": Infinity}}',
        '{"state": "RUNNING", "metrics": [{"step": 1' + "0" * 25 + "}]}",
        '{"state": "RUNNING", "metrics": [{"step": 3000000000}]}',
    ):
        response = client.post(url, content=body, headers=headers)
        assert response.status_code == 422, (body, response.text)
    assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "ADMITTED"
    diverged = client.post(url, content='{"state": "RUNNING", "metrics": [{"step": 1, "loss": NaN}]}', headers=headers)
    assert diverged.status_code == 200, "a NaN loss is a fact to record, not bad input"
    assert client.get(f"/v1/jobs/{job_id}/metrics").json()["items"][0]["loss"] is None
