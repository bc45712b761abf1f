"""Tenants, tokens and quotas over REST on both databases: isolation, 401s, admin routes, and the quota matrix
with the dispatcher admitting against a fake cluster."""

from __future__ import annotations

import json
import os
import stat
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from fastapi.testclient import TestClient
from sqlalchemy import text
from typer.testing import CliRunner

from ringmaster.api.app import create_app
from ringmaster.cli import admin as cli_admin
from ringmaster.cli import app as cli
from ringmaster.service import auth, tenants
from ringmaster.service.auth import Principal
from ringmaster.service.db import Database, alembic_config, make_engine, session_scope, upgrade_schema
from ringmaster.service.dispatcher import Dispatcher
from ringmaster.service.driver_handoff import DriverHandoff
from ringmaster.service.jobs import apply_driver_report, mark_admitted, submit_job
from ringmaster.service.models import Attempt, Job, Tenant
from ringmaster.service.reports import DriverReport
from ringmaster.service.settings import Settings
from ringmaster.service.spec import JobSpec
from tests.service.test_dispatcher import FakeCluster
from tests.support.api_tokens import mint

SPEC = {
    "name": "tenant-job",
    "model": "mlp",
    "workers": {"min": 1, "max": 1},
    "train": {"global_batch_size": 4, "micro_batch_size": 4},
}


def _spec(workers: tuple[int, int] = (1, 1), cpus: float = 1, gpus: int = 0, **extra: Any) -> dict[str, Any]:
    low, high = workers
    return {
        **SPEC,
        **extra,
        "workers": {"min": low, "max": high, "cpus_per_worker": cpus, "gpus_per_worker": gpus},
        "train": {"global_batch_size": 24, "micro_batch_size": 1},
    }  # 24: divisible by every world size used here


class RecordingCluster(FakeCluster):
    """The fake cluster, also keeping each attempt's report secret after its attempt closed."""

    def __init__(self, cpus: int) -> None:
        super().__init__(cpus)
        self.secrets: dict[str, str] = {}

    def submit(
        self,
        submission_id: str,
        entrypoint: str,
        runtime_env: dict[str, Any],
        metadata: dict[str, str],
        handoff: DriverHandoff,
    ) -> None:
        super().submit(submission_id, entrypoint, runtime_env, metadata, handoff)
        self.secrets[submission_id] = handoff.report_token.get_secret_value()


class Service:
    """The API in process with an admin and two tenants' tokens, and a dispatcher on the same database."""

    def __init__(self, client: TestClient, cluster_cpus: int = 64) -> None:
        self.client = client
        self.db: Database = client.app.state.db  # type: ignore[attr-defined]
        self.tokens = {
            "admin": mint(client.app, "ops", admin=True),  # type: ignore[arg-type]
            "a": mint(client.app, "team-a"),
            "b": mint(client.app, "team-b"),
        }  # type: ignore[arg-type]
        self.cluster = RecordingCluster(cluster_cpus)
        self.dispatcher = Dispatcher(
            self.db.sessions, self.cluster, Settings(api_url="http://cp", storage_uri="/ckpt"), owner="tenant-test"
        )

    def call(self, who: str | None, method: str, path: str, **kwargs: Any) -> Any:
        headers = kwargs.pop("headers", {})
        if who is not None:
            headers["Authorization"] = f"Bearer {self.tokens[who]}"
        return self.client.request(method, path, headers=headers, **kwargs)

    def submit(self, who: str, spec: dict[str, Any] | None = None) -> str:
        response = self.call(who, "POST", "/v1/jobs", json=spec or SPEC)
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def job(self, job_id: str) -> dict[str, Any]:
        return self.call("admin", "GET", f"/v1/jobs/{job_id}").json()

    def quota(self, tenant: str, **quota: Any) -> None:
        response = self.call("admin", "PUT", f"/v1/tenants/{tenant}", json=quota)
        assert response.status_code == 200, response.text

    def finish(self, job_id: str) -> None:
        """The driver reports success, with the secret its attempt was submitted with."""
        job = self.job(job_id)
        secret = self.cluster.secrets[job["ray_job_id"]]
        path = f"/v1/internal/jobs/{job_id}/attempts/{job['attempt']}/report"
        for state in ("RUNNING", "SUCCEEDED"):
            response = self.client.post(path, json={"state": state}, headers={"Authorization": f"Bearer {secret}"})
            assert response.status_code == 200, response.text


@pytest.fixture
def service(db_url: str, tmp_path: Path) -> Iterator[Service]:
    with TestClient(create_app(Settings(database_url=db_url, data_dir=tmp_path))) as client:
        yield Service(client)


# --- isolation -----------------------------------------------------------------------------------------------------

READS = ["", "/events", "/metrics", "/checkpoints", "/stream", "/logs"]


@pytest.mark.parametrize("path", READS)
def test_a_tenant_reads_only_its_own_jobs_and_an_admin_reads_all(service: Service, path: str) -> None:
    job_id = service.submit("a")
    service.client.app.state.logs_provider = lambda submission_id: f"log of {submission_id}"  # type: ignore[attr-defined]
    service.dispatcher.run_once()  # admitted: the job has a Ray job, so its logs can be served
    service.finish(job_id)  # terminal: its stream ends
    unknown = service.call("b", "GET", f"/v1/jobs/{'0' * 32}{path}")
    for who, expected in (("a", 200), ("admin", 200), ("b", 404)):
        response = service.call(who, "GET", f"/v1/jobs/{job_id}{path}")
        assert response.status_code == expected, (who, response.text)
    other = service.call("b", "GET", f"/v1/jobs/{job_id}{path}")
    assert other.json()["detail"] == unknown.json()["detail"].replace("0" * 32, job_id), (
        "another tenant's job reads as unknown"
    )


def test_listing_shows_each_tenant_its_own_jobs_and_an_admin_every_job(service: Service) -> None:
    a_jobs = {service.submit("a"), service.submit("a")}
    b_job = service.submit("b")

    def listed(who: str) -> set[str]:
        page = service.call(who, "GET", "/v1/jobs").json()
        assert page["total"] == len(page["items"])
        return {job["id"] for job in page["items"]}

    assert listed("a") == a_jobs and listed("b") == {b_job}
    assert listed("admin") == a_jobs | {b_job}
    assert {service.job(job_id)["tenant"] for job_id in a_jobs} == {"team-a"}


def test_another_tenants_cancel_is_404_and_changes_nothing(service: Service) -> None:
    job_id = service.submit("a")
    assert service.call("b", "POST", f"/v1/jobs/{job_id}/cancel").status_code == 404
    assert service.job(job_id)["state"] == "QUEUED"
    assert service.call("a", "POST", f"/v1/jobs/{job_id}/cancel").json()["state"] == "CANCELLED"
    second = service.submit("b")
    assert service.call("admin", "POST", f"/v1/jobs/{second}/cancel").json()["state"] == "CANCELLED"


def test_resume_from_another_tenants_job_is_refused_like_an_unknown_one(service: Service) -> None:
    theirs = service.submit("b")
    for reference in (theirs, theirs[:12]):  # a prefix finds only the tenant's own jobs too
        response = service.call("a", "POST", "/v1/jobs", json={**SPEC, "resume_from": reference})
        assert response.status_code == 422 and response.json()["detail"][0]["field"] == "resume_from"
    assert service.call("b", "POST", "/v1/jobs", json={**SPEC, "resume_from": theirs}).status_code == 201


def test_resume_from_takes_an_unambiguous_prefix_of_an_id_and_stores_the_whole_id(service: Service) -> None:
    """`ringmaster status` lists ids by their first 12 digits: that is what a user copies into resume_from."""
    ours = service.submit("a")
    response = service.call("a", "POST", "/v1/jobs", json={**SPEC, "resume_from": ours[:12]})
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["resume_from"] == ours
    assert service.job(response.json()["id"])["spec"]["resume_from"] == ours

    # 18 ids, the resuming job's among them (it is tenant a's too): by pigeonhole, at least two share a first hex digit.
    ids = [ours, response.json()["id"], *(service.submit("a") for _ in range(16))]
    shared = Counter(job[0] for job in ids).most_common(1)[0][0]
    sharing = sum(job.startswith(shared) for job in ids)
    response = service.call("a", "POST", "/v1/jobs", json={**SPEC, "resume_from": shared})
    assert response.status_code == 422
    assert response.json()["detail"][0]["msg"].startswith(
        f"resume_from: {shared!r} is the start of {sharing} job ids ("
    ), response.text

    unknown = "0" * 32 if not ours.startswith("0") else "f" * 32
    response = service.call("a", "POST", "/v1/jobs", json={**SPEC, "resume_from": unknown})
    assert response.json()["detail"][0]["msg"] == f"resume_from: no job with id {unknown!r}", response.text


# --- 401 and 403 ----------------------------------------------------------------------------------------------------

USER_ROUTES = [
    ("GET", "/v1/jobs"),
    ("POST", "/v1/jobs"),
    ("GET", f"/v1/jobs/{'0' * 32}"),
    ("POST", f"/v1/jobs/{'0' * 32}/cancel"),
    ("GET", f"/v1/jobs/{'0' * 32}/stream"),
    ("POST", "/v1/plan"),
    ("GET", "/v1/me"),
    ("GET", "/v1/tenants"),
]


@pytest.mark.parametrize(("method", "path"), USER_ROUTES)
@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "missing API token"),
        ("Basic dXNlcjpwYXNz", "malformed Authorization header"),
        ("Bearer", "malformed Authorization header"),
        ("Bearer rm_not-a-token", "invalid API token"),
    ],
)
def test_missing_malformed_or_unknown_token_is_401_before_anything_else(
    service: Service, method: str, path: str, header: str | None, message: str
) -> None:
    headers = {"Authorization": header} if header is not None else {}
    response = service.client.request(method, path, headers=headers, json={"not": "read"})
    assert response.status_code == 401 and message in response.json()["detail"]
    assert response.headers["www-authenticate"].startswith("Bearer")


def test_revoked_token_is_401_from_the_next_request(service: Service) -> None:
    created = service.call("admin", "POST", "/v1/tokens", json={"tenant": "team-c", "description": "ci"})
    assert created.status_code == 201 and created.json()["tenant_created"] is True
    token = created.json()["token"]
    me = service.client.get("/v1/me", headers={"Authorization": f"Bearer {token}"})
    assert me.json()["tenant"]["name"] == "team-c" and me.json()["admin"] is False
    revoked = service.call("admin", "POST", f"/v1/tokens/{created.json()['id']}/revoke")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    response = service.client.get("/v1/jobs", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 401 and "was revoked" in response.json()["detail"]


def test_a_request_cannot_revoke_its_own_token(service: Service) -> None:
    own = service.call("admin", "GET", "/v1/me").json()["token_id"]
    refused = service.call("admin", "POST", f"/v1/tokens/{own}/revoke")
    assert refused.status_code == 409 and "the one this request was made with" in refused.json()["detail"]
    assert service.call("admin", "GET", "/v1/me").status_code == 200, "the token still works"


def test_tokens_are_stored_hashed_and_never_listed(service: Service) -> None:
    listed = service.call("admin", "GET", "/v1/tokens", params={"tenant": "team-a"}).json()
    assert [token["tenant"] for token in listed] == ["team-a"] and "token" not in listed[0]
    with service.db.sessions() as session:
        stored = session.execute(text("SELECT token_hash FROM api_tokens")).scalars().all()
    assert service.tokens["a"] not in stored and auth.hash_secret(service.tokens["a"]) in stored


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/tenants", None),
        ("PUT", "/v1/tenants/team-a", {"jobs": 9}),
        ("POST", "/v1/tokens", {"tenant": "team-a"}),
        ("GET", "/v1/tokens", None),
        ("POST", "/v1/tokens/1/revoke", None),
    ],
)
def test_admin_routes_are_403_for_a_tenants_token(service: Service, method: str, path: str, body: Any) -> None:
    response = service.call("a", method, path, json=body)
    assert response.status_code == 403 and "admin token" in response.json()["detail"]


def test_a_tenant_sees_its_own_quota_but_not_anothers(service: Service) -> None:
    service.quota("team-b", gpus=8)
    assert service.call("b", "GET", "/v1/tenants/team-b").json()["quota"] == {"gpus": 8, "cpus": None, "jobs": None}
    assert service.call("a", "GET", "/v1/tenants/team-b").status_code == 404


def test_open_routes_need_no_token(service: Service) -> None:
    for path in ("/healthz", "/metrics", "/openapi.json"):
        assert service.client.get(path).status_code == 200, path
    schema = service.client.get("/openapi.json").json()
    assert schema["paths"]["/v1/jobs"]["get"]["security"] == [{"token": []}]
    assert schema["paths"]["/v1/internal/jobs/{job_id}/attempts/{attempt}/report"]["post"]["security"] == [
        {"reportToken": []}
    ]


# --- quotas -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quota", "spec", "needle"),
    [
        ({"gpus": 2}, _spec((3, 4), gpus=1), "3 GPUs exceeds tenant 'team-a''s GPU quota of 2"),
        ({"cpus": 1.5}, _spec((2, 2), cpus=1), "2 CPUs exceeds tenant 'team-a''s CPU quota of 1.5"),
        ({"jobs": 0}, _spec(), "quota of 0 concurrent jobs"),
    ],
)
def test_job_larger_than_its_quota_is_rejected_at_submit(
    service: Service, quota: dict[str, Any], spec: dict[str, Any], needle: str
) -> None:
    service.quota("team-a", **quota)
    response = service.call("a", "POST", "/v1/jobs", json=spec)
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["type"] == "quota_exceeded" and needle in error["msg"]
    assert service.call("admin", "GET", "/v1/jobs").json()["total"] == 0


@pytest.mark.parametrize(
    ("quota", "spec"),
    [
        ({"jobs": 1}, _spec()),
        ({"cpus": 3}, _spec((2, 2), cpus=1)),
        ({"gpus": 3}, _spec((2, 2), gpus=1, cpus=0.5)),
    ],
)
def test_job_over_quota_waits_with_its_reason_and_runs_when_quota_frees(
    service: Service, quota: dict[str, Any], spec: dict[str, Any]
) -> None:
    service.quota("team-a", **quota)
    first, second = service.submit("a", spec), service.submit("a", spec)
    other_tenant = service.submit("b", spec)
    service.dispatcher.run_once()
    assert service.job(first)["state"] == "ADMITTED" and service.job(first)["waiting_reason"] is None
    waiting = service.job(second)
    assert waiting["state"] == "QUEUED" and waiting["waiting_reason"].startswith("over quota: tenant 'team-a'")
    assert service.job(other_tenant)["state"] == "ADMITTED", "one tenant's quota does not hold back another's jobs"
    assert service.call("a", "GET", "/v1/me").json()["tenant"]["usage"]["jobs"] == 1

    service.finish(first)
    service.dispatcher.run_once()
    admitted = service.job(second)
    assert admitted["state"] == "ADMITTED" and admitted["waiting_reason"] is None


def test_elastic_job_is_granted_what_the_quota_leaves_and_its_driver_is_capped_there(service: Service) -> None:
    service.quota("team-a", cpus=3)
    job_id = service.submit("a", _spec((1, 4), cpus=1))
    service.dispatcher.run_once()
    job = service.job(job_id)
    assert job["state"] == "ADMITTED"
    with service.db.sessions() as session:
        attempt = session.query(Attempt).filter_by(job_id=job_id).one()
        assert (attempt.world_size, attempt.max_workers) == (3, 3)
    carried = service.cluster.handoffs[job["ray_job_id"]].spec
    assert (carried.workers.min, carried.workers.max) == (1, 3)
    assert service.call("admin", "GET", "/v1/tenants/team-a").json()["usage"] == {"gpus": 0, "cpus": 3.0, "jobs": 1}


def test_standby_workers_count_against_the_quota(service: Service) -> None:
    service.quota("team-a", cpus=3)
    spec = _spec((1, 4), cpus=1)
    spec["workers"]["standby"] = 1
    job_id = service.submit("a", spec)
    service.dispatcher.run_once()
    with service.db.sessions() as session:
        attempt = session.query(Attempt).filter_by(job_id=job_id).one()
        assert attempt.max_workers == 2, "two workers and one standby fill a quota of three CPUs"
    assert service.call("admin", "GET", "/v1/tenants/team-a").json()["usage"] == {"gpus": 0, "cpus": 3.0, "jobs": 1}

    too_large = _spec((3, 3), cpus=1)
    too_large["workers"]["standby"] = 1
    response = service.call("a", "POST", "/v1/jobs", json=too_large)
    assert response.status_code == 422
    assert (
        "workers.min (3) + workers.standby (1) × workers.cpus_per_worker (1) = 4 CPUs"
        in response.json()["detail"][0]["msg"]
    )


def test_lowering_a_quota_holds_back_only_later_admissions(service: Service) -> None:
    first = service.submit("a", _spec((2, 2)))
    service.dispatcher.run_once()
    service.quota("team-a", cpus=2)
    second = service.submit("a", _spec((2, 2)))
    service.dispatcher.run_once()
    assert (service.job(first)["state"], service.job(second)["state"]) == ("ADMITTED", "QUEUED")
    assert "holds 2 of its 2 CPU(s)" in service.job(second)["waiting_reason"]


def test_no_capacity_is_a_waiting_reason_too(service: Service) -> None:
    job_id = service.submit("a", _spec((8, 8)))
    service.cluster.free_cpus = 4
    service.dispatcher.run_once()
    assert service.job(job_id)["waiting_reason"] == "reserved: head of the queue, waits for 4 CPUs more to free"


def test_report_secret_travels_in_the_drivers_handoff_and_is_bound_to_its_attempt(service: Service) -> None:
    job_id = service.submit("a")
    service.dispatcher.run_once()
    submission_id = service.job(job_id)["ray_job_id"]
    secret = service.cluster.secrets[submission_id]
    shown = [
        service.cluster.submitted[submission_id],
        service.cluster.runtime_envs[submission_id],
        service.cluster.metadata[submission_id],
    ]
    assert secret not in json.dumps(shown), "the Ray dashboard shows the command line, runtime env and metadata"
    with service.db.sessions() as session:
        assert session.query(Attempt).filter_by(job_id=job_id).one().report_token_hash == auth.hash_secret(secret)
    path = f"/v1/internal/jobs/{job_id}/attempts/1/report"
    for token in (service.tokens["admin"], service.tokens["a"]):  # user tokens cannot forge reports
        assert (
            service.client.post(
                path, json={"state": "RUNNING"}, headers={"Authorization": f"Bearer {token}"}
            ).status_code
            == 401
        )
    assert (
        service.client.post(path, json={"state": "RUNNING"}, headers={"Authorization": f"Bearer {secret}"}).status_code
        == 200
    )


# --- the local admin token, the CLI, the migration -------------------------------------------------------------------


def test_embedded_server_writes_a_private_admin_token_and_keeps_it(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)  # no database URL: the embedded defaults
    with TestClient(create_app(settings)) as client:
        token = settings.client_token()
        assert token and stat.S_IMODE(os.stat(settings.local_token_path()).st_mode) == 0o600
        me = client.get("/v1/me", headers={"Authorization": f"Bearer {token}"}).json()
        assert me["admin"] is True and me["tenant"]["name"] == "default"
        with session_scope(client.app.state.db.sessions) as session:  # type: ignore[attr-defined]
            auth.revoke_token(session, me["token_id"])
    with TestClient(create_app(settings)) as client:
        renewed = settings.client_token()
        assert renewed != token, "a revoked local token is replaced"
        assert client.get("/v1/me", headers={"Authorization": f"Bearer {renewed}"}).status_code == 200
    with TestClient(create_app(settings)):
        assert settings.client_token() == renewed, "a working local token is kept across restarts"


def test_server_on_an_external_database_writes_no_token(db_url: str, tmp_path: Path) -> None:
    with TestClient(create_app(Settings(database_url=db_url, data_dir=tmp_path))):
        assert not (tmp_path / "admin.token").exists()


def test_cli_creates_tenants_and_tokens_directly_in_the_database(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_admin, "get_settings", lambda: Settings(database_url=db_url, data_dir=tmp_path))
    runner = CliRunner()
    created = runner.invoke(cli.app, ["tenant", "create", "vision", "--gpus", "8", "--jobs", "2"])
    assert created.exit_code == 0, created.output
    assert runner.invoke(cli.app, ["tenant", "create", "vision"]).exit_code == 1
    assert runner.invoke(cli.app, ["tenant", "quota", "vision", "--gpus", "unlimited", "--cpus", "32"]).exit_code == 0
    issued = runner.invoke(cli.app, ["token", "create", "--tenant", "vision"])
    assert issued.exit_code == 0, issued.output
    secret = issued.output.strip().splitlines()[-1]
    admin = runner.invoke(cli.app, ["token", "create", "--tenant", "newcomers", "--admin"])
    assert "created tenant 'newcomers'" in admin.output
    upgrade_schema(db_url)
    database = Database.connect(db_url)
    try:
        with session_scope(database.sessions) as session:
            principal = auth.authenticate(session, secret)
            assert (principal.tenant, principal.admin) == ("vision", False)
            tenant = session.get(Tenant, "vision")
            assert (tenant.quota_gpus, tenant.quota_cpus, tenant.quota_jobs) == (None, 32.0, 2)
        assert runner.invoke(cli.app, ["token", "revoke", str(principal.token_id)]).exit_code == 0
        with session_scope(database.sessions) as session, pytest.raises(auth.Unauthorized):
            auth.authenticate(session, secret)
    finally:
        database.dispose()
    assert runner.invoke(cli.app, ["tenant", "create", "Bad Name"]).exit_code == 1


def test_upgrade_moves_existing_jobs_to_the_default_tenant(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            command.upgrade(alembic_config(connection), "0002")
            connection.execute(
                text(
                    "INSERT INTO jobs (id, name, spec, state, priority, attempt, failures, created_at, "
                    "cancel_requested) VALUES ('0123456789abcdef0123456789abcdef', 'old', '{}', 'QUEUED', 0, 0, 0, "
                    "CURRENT_TIMESTAMP, false)"
                )
            )
        upgrade_schema(db_url)
        with engine.connect() as connection:
            assert connection.execute(text("SELECT tenant, waiting_reason FROM jobs")).one() == ("default", None)
            assert connection.execute(text("SELECT name, quota_jobs FROM tenants")).all() == [("default", None)]
    finally:
        engine.dispose()


def test_quota_grant_counts_admitted_jobs_at_their_grant_not_their_current_size(db: Database) -> None:
    """A job that shrank after a node loss may grow back to its grant: its quota stays held."""
    with session_scope(db.sessions) as session:
        tenants.put_tenant(session, "team-a", tenants.Quota(cpus=4))
        owner = Principal("team-a", admin=False)
        first = submit_job(session, JobSpec.model_validate(_spec((1, 4))), principal=owner)
        mark_admitted(session, first, 1, f"ringmaster-{first.id}-1", None, world_size=1, max_workers=3)
        second = submit_job(session, JobSpec.model_validate(_spec((1, 4))), principal=owner)
        assert tenants.usage(session, "team-a") == tenants.Usage(gpus=0, cpus=3.0, jobs=1)
        assert tenants.grant(session, second, JobSpec.model_validate(second.spec)) == tenants.Grant(1)
        apply_driver_report(session, first.id, 1, DriverReport(state="RUNNING"))
        apply_driver_report(session, first.id, 1, DriverReport(state="FAILED", message="lost"))
        assert tenants.usage(session, "team-a") == tenants.Usage()
        assert session.get(Job, second.id).tenant == "team-a"
