"""No secret in what the Ray dashboard shows: an attempt's report secret reaches its driver through the GCS's key-value
store (service/driver_handoff.py), and neither it nor an API token is in the Jobs, state (actors, tasks, …) or logs
APIs, which any client of the dashboard may read."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest

from harness.local_control_plane import wait_for_state
from ringmaster.service import auth, driver_handoff
from ringmaster.service.driver_handoff import HANDOFF_NAMESPACE, DriverHandoff, HandoffMissing, handoff_key

pytestmark = pytest.mark.integration

_STATE_APIS = ["jobs", "actors", "tasks", "workers", "runtime_envs", "placement_groups", "nodes", "objects"]


def _spec(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "model": "mlp",
        "data": "synthetic",
        "strategy": "ddp",
        "workers": {"min": 2, "max": 2, "cpus_per_worker": 1},
        "train": {"steps": 5, "global_batch_size": 8, "micro_batch_size": 4},
        "checkpoint": {"every_steps": 0, "keep": 1},
    }


@pytest.fixture
def minted_report_secrets(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every report secret the dispatcher (in this process) mints meanwhile: only its hash is stored."""
    minted: list[str] = []
    mint = auth.new_report_token

    def keep() -> tuple[str, str]:
        secret, hashed = mint()
        minted.append(secret)
        return secret, hashed

    monkeypatch.setattr(auth, "new_report_token", keep)
    yield minted


def _dashboard(shared_ray_head: Any) -> httpx.Client:
    """The head's dashboard, with its token when the head runs with Ray's token authentication."""
    auth_ = getattr(shared_ray_head, "auth", None)  # RayHead.auth: None on a head without authentication
    headers = auth_.headers() if auth_ is not None else {}
    return httpx.Client(base_url=shared_ray_head.dashboard_url, headers=headers, timeout=30)


def _everything_the_dashboard_shows(dashboard: httpx.Client, submission_id: str) -> dict[str, bytes]:
    """path -> body of the Jobs API's list, job and driver log, every state API's list, and every log file of every
    node as the logs API lists and serves it."""
    shown: dict[str, bytes] = {}

    def get(path: str, **params: Any) -> bytes:
        response = dashboard.get(path, params=params)
        assert response.status_code == 200, (path, response.status_code, response.text[:500])
        shown[f"{path}?{urlencode(params)}" if params else path] = response.content
        return response.content

    get("/api/jobs/")
    get(f"/api/jobs/{submission_id}")
    get(f"/api/jobs/{submission_id}/logs")
    for resource in _STATE_APIS:
        get(f"/api/v0/{resource}", limit=10_000, detail="true")
    nodes = dashboard.get("/api/v0/nodes", params={"limit": 10_000}).json()["data"]["result"]["result"]
    for node in nodes:
        if node["state"] != "ALIVE":
            continue
        get("/api/v0/logs", node_id=node["node_id"])
        listing = dashboard.get("/api/v0/logs", params={"node_id": node["node_id"]}).json()["data"]["result"]
        for filename in sorted({name for names in listing.values() for name in names if not name.endswith("/")}):
            get("/api/v0/logs/file", node_id=node["node_id"], filename=filename, lines=-1)
    return shown


def test_no_report_secret_or_api_token_in_rays_jobs_state_or_logs_apis(
    ray_server: Any, shared_ray_head: Any, minted_report_secrets: list[str]
) -> None:
    client = ray_server.client()
    job = client.submit(_spec("no-secrets"))
    done = wait_for_state(client, job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert done["state"] == "SUCCEEDED", done["error"]  # its driver reported: it had the secret
    submission_id = done["ray_job_id"]
    assert len(minted_report_secrets) == done["attempt"] == 1

    from ringmaster.service.ray_internals import RayInternalKv

    assert RayInternalKv().get(HANDOFF_NAMESPACE, handoff_key(submission_id)) is None, "the driver took its handoff"

    secrets = {"the attempt's report secret": minted_report_secrets[0], "the API token": ray_server.token}
    head_auth = getattr(shared_ray_head, "auth", None)
    if head_auth is not None:
        secrets["the Ray cluster's own token"] = head_auth.value()
    with _dashboard(shared_ray_head) as dashboard:
        started = time.monotonic()
        shown = _everything_the_dashboard_shows(dashboard, submission_id)
        read_s = time.monotonic() - started
    print(f"read {len(shown)} dashboard responses, {sum(map(len, shown.values())) / 1e6:.1f} MB, in {read_s:.1f} s")
    # What would be there if the secrets were: the job, its driver's log, the workers' actors, log files.
    assert submission_id.encode() in shown["/api/jobs/"]
    assert f"job {job['id']} attempt 1 ended with code 0".encode() in shown[f"/api/jobs/{submission_id}/logs"]
    assert any(name.startswith("/api/v0/logs/file") for name in shown)
    for what, secret in secrets.items():
        assert secret, what
        found = [path for path, body in shown.items() if secret.encode() in body]
        assert not found, f"{what} is in the dashboard's answer to {found}"


def test_rays_internal_kv_keeps_the_meaning_the_handoff_relies_on(ray_server: Any) -> None:
    """Each Ray call behind service/ray_internals.py, on the live cluster this process watches: a Ray release that
    changes one fails here, by name."""
    from ringmaster.service.ray_internals import RayInternalKv

    store = RayInternalKv()
    key = f"test-key-{time.monotonic_ns()}"
    assert store.get(HANDOFF_NAMESPACE, key) is None
    store.put(HANDOFF_NAMESPACE, key, b"first")
    store.put(HANDOFF_NAMESPACE, key, b"second")
    assert store.get(HANDOFF_NAMESPACE, key) == b"second", "put replaces"
    assert store.get("another-namespace", key) is None, "namespaces are apart"
    store.put(HANDOFF_NAMESPACE, f"{key}-longer", b"kept")
    assert store.delete(HANDOFF_NAMESPACE, key) is True
    assert store.delete(HANDOFF_NAMESPACE, key) is False, "a second delete finds nothing"
    assert store.get(HANDOFF_NAMESPACE, key) is None
    assert store.get(HANDOFF_NAMESPACE, f"{key}-longer") == b"kept", "a delete removes its one key, no prefix"
    store.delete(HANDOFF_NAMESPACE, f"{key}-longer")

    from ringmaster.service.spec import JobSpec

    spec = JobSpec.model_validate(_spec("handed-off"))
    driver_handoff.put(store, "ringmaster-kvtest-1", DriverHandoff(report_token="t", spec=spec).to_json())
    assert driver_handoff.take(store, "ringmaster-kvtest-1").spec == spec
    with pytest.raises(HandoffMissing):
        driver_handoff.take(store, "ringmaster-kvtest-1")


def test_a_driver_whose_handoff_is_gone_stops_at_once_saying_so(ray_server: Any, shared_ray_head: Any) -> None:
    """Taken by another process, or dropped when its attempt closed: the driver runs nothing without its secret."""
    import sys

    from ray.job_submission import JobStatus, JobSubmissionClient

    from harness.local_control_plane import REPO_ROOT
    from ringmaster.service.naming import submission_id_for

    job_id = uuid.uuid4().hex
    auth_ = getattr(shared_ray_head, "auth", None)
    jobs = JobSubmissionClient(shared_ray_head.dashboard_url, headers=auth_.headers() if auth_ is not None else None)
    submission_id = jobs.submit_job(
        submission_id=submission_id_for(job_id, 1),
        entrypoint=(
            f"{sys.executable} -m ringmaster.workers.driver --job-id {job_id} --attempt 1 --placement-group none "
            f"--api-url http://127.0.0.1:9 --storage-uri /nonexistent --ray-address {shared_ray_head.gcs_address}"
        ),
        entrypoint_num_cpus=0,
        runtime_env={"env_vars": {"PYTHONPATH": ray_server.plane.settings.code_path or str(REPO_ROOT)}},
    )
    deadline = time.monotonic() + 120
    while not (status := jobs.get_job_status(submission_id)).is_terminal():
        assert time.monotonic() < deadline, f"the driver did not end: {status}"
        time.sleep(0.25)
    info = jobs.get_job_info(submission_id)
    assert status == JobStatus.FAILED and info.driver_exit_code == 1, info
    assert f"no handoff for Ray job {submission_id}" in jobs.get_job_logs(submission_id)
