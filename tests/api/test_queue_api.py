"""GET /v1/queue and /v1/queue/shares, the tenants' weight over the admin API, the scheduler's Prometheus series, and
the queue page of the web view (served, linked, drawn from the vendored chart library): on both databases."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ringmaster.api.app import create_app
from ringmaster.service import queue_view, telemetry
from ringmaster.service.db import Database, session_scope
from ringmaster.service.models import Job, utcnow
from ringmaster.service.queue_view import ShareSample
from ringmaster.service.settings import Settings
from tests.support.api_tokens import authorize, mint

SPEC = {"name": "queued", "model": "mlp", "train": {"global_batch_size": 16, "micro_batch_size": 4}}
WEB = Path(__file__).resolve().parents[2] / "api" / "web"


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(database_url=db_url, data_dir=tmp_path))) as test_client:
        authorize(test_client)
        yield test_client


def _db(client: TestClient) -> Database:
    app: FastAPI = client.app  # type: ignore[assignment]
    return app.state.db


def _as(client: TestClient, tenant: str, *, admin: bool = False) -> dict[str, str]:
    return {"Authorization": f"Bearer {mint(client.app, tenant, admin=admin)}"}  # type: ignore[arg-type]


def _submit(client: TestClient, headers: dict[str, str], name: str) -> str:
    response = client.post("/v1/jobs", json={**SPEC, "name": name}, headers=headers)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _plan(client: TestClient, order: list[str], reason: str = "no capacity") -> None:
    with session_scope(_db(client).sessions) as session:
        for position, job_id in enumerate(order, start=1):
            job = session.get(Job, job_id)
            assert job is not None
            job.queue_position, job.waiting_reason = position, f"{reason} ({position})"


@pytest.fixture
def two_teams(client: TestClient) -> dict[str, Any]:
    """Team a's two jobs and team b's one, planned b, a, a; a sample of both teams' shares."""
    a, b = _as(client, "team-a"), _as(client, "team-b")
    a1, b1, a2 = _submit(client, a, "a-one"), _submit(client, b, "b-one"), _submit(client, a, "a-two")
    _plan(client, [b1, a2, a1])
    with session_scope(_db(client).sessions) as session:
        queue_view.record_shares(
            session,
            utcnow() - timedelta(seconds=5),
            [ShareSample("team-a", 2, 0.0, 0.5, 0.4, 0.5), ShareSample("team-b", 0, 1.0, 0.1, 0.2, 0.5)],
        )
    return {"a": a, "b": b, "a1": a1, "a2": a2, "b1": b1}


def test_an_admin_sees_every_tenants_jobs_in_plan_order_with_reasons_and_every_standing(
    client: TestClient, two_teams: dict[str, Any]
) -> None:
    answer = client.get("/v1/queue").json()
    assert [(job["id"], job["position"]) for job in answer["items"]] == [
        (two_teams["b1"], 1),
        (two_teams["a2"], 2),
        (two_teams["a1"], 3),
    ]
    first = answer["items"][0]
    assert first["waiting_reason"] == "no capacity (1)" and first["tenant"] == "team-b"
    assert first["workers"] == {"min": 1, "max": 1, "cpus_per_worker": 1.0, "gpus_per_worker": 0}
    assert first["preemptions"] == 0 and first["preempted_for"] is None and first["queued_since"].endswith("Z")
    assert (answer["total"], answer["limit"], answer["offset"]) == (3, 100, 0)
    standing = {tenant["name"]: tenant for tenant in answer["tenants"]}
    assert {"team-a", "team-b", "default"} <= set(standing)
    assert standing["team-a"]["share"] == 0.5 and standing["team-a"]["decayed_share"] == 0.4
    assert standing["team-b"]["held_cpus"] == 1.0 and standing["team-b"]["entitled_share"] == 0.5
    assert standing["default"]["share"] == 0.0 and standing["default"]["sampled_at"] is None
    only_b = client.get("/v1/queue", params={"tenant": "team-b"}).json()
    assert [job["id"] for job in only_b["items"]] == [two_teams["b1"]]
    assert [tenant["name"] for tenant in only_b["tenants"]] == ["team-b"]


def test_a_tenant_sees_its_own_jobs_at_their_global_positions_and_only_its_standing(
    client: TestClient, two_teams: dict[str, Any]
) -> None:
    answer = client.get("/v1/queue", headers=two_teams["a"]).json()
    assert [(job["id"], job["position"]) for job in answer["items"]] == [(two_teams["a2"], 2), (two_teams["a1"], 3)]
    assert answer["total"] == 2
    assert [tenant["name"] for tenant in answer["tenants"]] == ["team-a"]
    own = client.get("/v1/queue", params={"tenant": "team-a"}, headers=two_teams["a"]).json()
    assert own == answer


def test_a_tenant_asking_for_another_tenants_queue_gets_nothing_of_it(
    client: TestClient, two_teams: dict[str, Any]
) -> None:
    response = client.get("/v1/queue", params={"tenant": "team-b"}, headers=two_teams["a"])
    assert response.status_code == 200
    assert response.json() == {"items": [], "total": 0, "limit": 100, "offset": 0, "tenants": []}
    series = client.get("/v1/queue/shares", params={"tenant": "team-b"}, headers=two_teams["a"]).json()
    assert series["series"] == []


def test_the_queue_pages_with_limit_and_offset(client: TestClient) -> None:
    ids = [_submit(client, {}, f"job-{index}") for index in range(5)]
    _plan(client, ids)
    page = client.get("/v1/queue", params={"limit": 2, "offset": 2}).json()
    assert [job["id"] for job in page["items"]] == ids[2:4]
    assert (page["total"], page["limit"], page["offset"]) == (5, 2, 2)
    assert client.get("/v1/queue", params={"offset": 5}).json()["items"] == []


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"offset": -1}, "offset"),
        ({"tenant": "Not A Tenant"}, "tenant"),
        ({"limit": "many"}, "limit"),
    ],
)
def test_bad_queue_parameters_are_422_naming_the_field(client: TestClient, params: dict[str, Any], field: str) -> None:
    response = client.get("/v1/queue", params=params)
    assert response.status_code == 422, response.text
    assert [error["field"] for error in response.json()["detail"]] == [field]


def test_the_queue_needs_a_token(client: TestClient) -> None:
    response = client.get("/v1/queue", headers={"Authorization": ""})
    assert response.status_code == 401 and "token" in response.json()["detail"]


def test_the_share_series_is_each_visible_tenants_samples_in_the_window(
    client: TestClient, two_teams: dict[str, Any]
) -> None:
    with session_scope(_db(client).sessions) as session:
        queue_view.record_shares(session, utcnow() - timedelta(minutes=90), [ShareSample("team-a", share=0.9)])
    answer = client.get("/v1/queue/shares").json()
    series = {entry["tenant"]: entry["points"] for entry in answer["series"]}
    assert set(series) == {"team-a", "team-b"}
    assert [point["share"] for point in series["team-a"]] == [0.5]  # the sample 90 minutes ago is outside the hour
    assert series["team-b"][0]["entitled_share"] == 0.5
    longer = client.get("/v1/queue/shares", params={"minutes": 120}).json()
    assert [p["share"] for p in next(e["points"] for e in longer["series"] if e["tenant"] == "team-a")] == [0.9, 0.5]
    own = client.get("/v1/queue/shares", headers=two_teams["b"]).json()
    assert [entry["tenant"] for entry in own["series"]] == ["team-b"]
    too_far = client.get("/v1/queue/shares", params={"minutes": 7 * 24 * 60 + 1})
    assert too_far.status_code == 422 and too_far.json()["detail"][0]["field"] == "minutes"


def test_an_admin_sets_a_tenants_weight_and_a_quota_change_keeps_it(client: TestClient) -> None:
    created = client.put("/v1/tenants/team-w", json={"gpus": 4}).json()
    assert created["weight"] == 1.0
    weighted = client.put("/v1/tenants/team-w", json={"gpus": 4, "weight": 2.5})
    assert weighted.status_code == 200 and weighted.json()["weight"] == 2.5
    assert client.put("/v1/tenants/team-w", json={"gpus": 8}).json()["weight"] == 2.5
    assert client.get("/v1/tenants/team-w").json()["weight"] == 2.5
    standing = client.get("/v1/queue", params={"tenant": "team-w"}).json()["tenants"]
    assert standing[0]["weight"] == 2.5 and standing[0]["quota"]["gpus"] == 8


@pytest.mark.parametrize("weight", [0, -1, 1000.5, "heavy"])
def test_a_weight_out_of_range_is_422_naming_weight_and_changes_nothing(client: TestClient, weight: Any) -> None:
    client.put("/v1/tenants/team-w", json={"weight": 3})
    response = client.put("/v1/tenants/team-w", json={"weight": weight})
    assert response.status_code == 422, response.text
    assert [error["field"] for error in response.json()["detail"]] == ["weight"]
    assert client.get("/v1/tenants/team-w").json()["weight"] == 3


def test_a_tenant_cannot_set_a_weight(client: TestClient) -> None:
    response = client.put("/v1/tenants/team-a", json={"weight": 100}, headers=_as(client, "team-a"))
    assert response.status_code == 403


def _samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = client.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_show_each_tenants_share_and_the_queue_length(client: TestClient, two_teams: dict[str, Any]) -> None:
    samples = _samples(client)
    assert samples[("ringmaster_queue_length", ())] == 3
    assert samples[("ringmaster_tenant_share", (("tenant", "team-a"),))] == 0.5
    assert samples[("ringmaster_tenant_decayed_share", (("tenant", "team-a"),))] == 0.4
    assert samples[("ringmaster_tenant_decayed_share", (("tenant", "team-b"),))] == 0.2
    assert samples[("ringmaster_tenant_entitled_share", (("tenant", "team-b"),))] == 0.5


def test_preemptions_and_resizes_count_once_their_transaction_commits(
    client: TestClient, two_teams: dict[str, Any]
) -> None:
    sessions = _db(client).sessions
    with session_scope(sessions) as session:
        job = session.get(Job, two_teams["a1"])
        assert job is not None
        telemetry.record_preemption(session, job)
        telemetry.record_resize(session, 4, 2)
        telemetry.record_resize(session, 2, 3)
        telemetry.record_resize(session, 3, 3)  # no change: nothing to count
    with pytest.raises(RuntimeError), session_scope(sessions) as session:
        telemetry.record_preemption(session, job)
        telemetry.record_resize(session, 1, 2)
        raise RuntimeError("rolled back")
    samples = _samples(client)
    assert samples[("ringmaster_preemptions_total", (("tenant", "team-a"),))] == 1
    assert samples[("ringmaster_resizes_total", (("direction", "shrink"),))] == 1
    assert samples[("ringmaster_resizes_total", (("direction", "grow"),))] == 1


def test_the_queue_page_is_served_linked_from_every_page_and_charts_with_the_vendored_library(
    client: TestClient,
) -> None:
    page = client.get("/ui/queue")
    assert page.status_code == 200 and 'href="/ui/queue"' in page.text
    assert "/ui/static/vendor/uplot-1.6.31/uPlot.iife.min.js" in page.text
    assert not re.search(r"""(src|href)=["']https?://""", page.text), "the view loads nothing from another host"
    script = client.get("/ui/static/app.js").text
    assert 'path === "/ui/queue"' in script and "queuePage()" in script
    assert '"/v1/queue?' in script and "/v1/queue/shares?minutes=" in script and "new uPlot(" in script
    assert not re.search(r"https?://", script), "the script fetches nothing from another host"
    assert client.get("/ui/static/vendor/uplot-1.6.31/uPlot.iife.min.js").status_code == 200
