"""`ringmaster queue` in a subprocess against a real HTTP server: the queue table in plan order with each job's reason,
the tenants' fair-share table, --tenant, --json; and `ringmaster tenant quota/create --weight`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from harness.ports import free_port
from ringmaster.api.app import create_app
from ringmaster.service import jobs, queue_view, tenants
from ringmaster.service.auth import Principal
from ringmaster.service.db import session_scope
from ringmaster.service.errors import NodeNotFound
from ringmaster.service.models import Job, Tenant, utcnow
from ringmaster.service.queue_view import ShareSample
from ringmaster.service.settings import Settings
from ringmaster.service.spec import JobSpec

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str
    data_dir: Path
    app: FastAPI
    job_ids: dict[str, str]


def _seed(app: FastAPI) -> dict[str, str]:
    """Team a's job waiting on quota behind team b's, which was preempted once; an unplanned job last; shares."""
    ids = {}
    with session_scope(app.state.db.sessions) as session:
        for name, tenant, workers in (
            ("a-waits", "team-a", {"min": 2, "max": 4, "cpus_per_worker": 0.5}),
            ("b-first", "team-b", {"min": 1, "max": 1}),
            ("a-late", "team-a", {"min": 1, "max": 1}),
        ):
            tenants.ensure_tenant(session, tenant)
            spec = JobSpec.model_validate(
                {"name": name, "model": "mlp", "workers": workers, "train": {"global_batch_size": 48}}
            )
            ids[name] = jobs.submit_job(session, spec, principal=Principal(tenant, admin=False)).id
        tenants.put_tenant(session, "team-a", tenants.Quota(gpus=4), weight=3)
    with session_scope(app.state.db.sessions) as session:
        for name, position, reason in (
            ("b-first", 1, "no capacity: 1 CPU short"),
            ("a-waits", 2, "over quota: tenant 'team-a' holds 4 of its 4 GPU(s)"),
        ):
            job = session.get(Job, ids[name])
            assert job is not None
            job.queue_position, job.waiting_reason = position, reason
            if name == "b-first":
                job.preemptions, job.preempted_for = 1, "c" * 32
        queue_view.record_shares(
            session,
            utcnow() - timedelta(seconds=3),
            [ShareSample("team-a", 4, 0.0, 0.5, 0.625, 0.75), ShareSample("team-b", 0, 2.0, 0.125, 0.1, 0.25)],
        )
    return ids


DRAINABLE = "ab" * 28
DRAINED: list[tuple[str, float | None, str]] = []


def _drain(node_id: str, deadline: float | None, reason: str) -> None:
    """The cluster's side of a drain: one node exists."""
    if node_id != DRAINABLE:
        raise NodeNotFound(f"no live Ray node has id {node_id!r}")
    DRAINED.append((node_id, deadline, reason))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The API on an embedded SQLite database (which writes its local admin token), with no cluster behind it."""
    data_dir = tmp_path_factory.mktemp("queue-cli")
    settings = Settings(data_dir=data_dir, api_port=free_port())
    app = create_app(settings, node_drainer=_drain)
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.api_port, log_level="warning"))
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uvicorn_server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the API server did not start"
        time.sleep(0.05)
    yield Server(settings.resolved_api_url(), data_dir, app, _seed(app))
    uvicorn_server.should_exit = True
    thread.join(timeout=10)


def ringmaster(*args: str, env: dict[str, str], columns: int = 200) -> subprocess.CompletedProcess[str]:
    """The CLI as a person runs it (a fresh process), with only the given RINGMASTER_* variables."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith("RINGMASTER_")}
    return subprocess.run(
        [sys.executable, "-m", "ringmaster.cli", *args],
        cwd=REPO_ROOT,
        text=True,
        capture_output=True,
        timeout=60,
        env={**clean, "COLUMNS": str(columns), **env},
    )


def at(server: Server) -> dict[str, str]:
    return {"RINGMASTER_API_URL": server.url, "RINGMASTER_DATA_DIR": str(server.data_dir)}


def _line_of(output: str, text: str) -> int:
    found = [number for number, line in enumerate(output.splitlines()) if text in line]
    assert len(found) == 1, f"{text!r} on {len(found)} lines, not one:\n{output}"
    return found[0]


def test_queue_lists_jobs_in_plan_order_with_why_and_the_tenants_standing(server: Server) -> None:
    result = ringmaster("queue", env=at(server))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    first, second, last = (_line_of(out, name) for name in ("b-first", "a-waits", "a-late"))
    assert first < second < last
    b_row, a_row, late_row = (out.splitlines()[index] for index in (first, second, last))
    assert "│ 1 " in b_row and "no capacity: 1 CPU short (preempted 1× for cccccccccccc)" in b_row
    assert "│ 2 " in a_row and "2-4 × 0.5 CPU" in a_row and "over quota: tenant 'team-a' holds 4 of its 4" in a_row
    assert "│ - " in late_row and "not planned yet" in late_row
    standing = {line.split("│")[1].strip(): line.split("│")[2:] for line in out.splitlines() if "%" in line}
    assert [cell.strip() for cell in standing["team-a"][:-1]] == ["3", "50.0%", "62.5%", "75.0%", "4 GPU, 0 CPU"]
    assert [cell.strip() for cell in standing["team-b"][:-1]] == ["1", "12.5%", "10.0%", "25.0%", "0 GPU, 2 CPU"]


def test_queue_of_one_tenant_keeps_the_global_positions(server: Server) -> None:
    result = ringmaster("queue", "--tenant", "team-a", env=at(server))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "b-first" not in result.stdout and "│ 2 " in result.stdout.splitlines()[_line_of(result.stdout, "a-waits")]
    assert "team-b" not in result.stdout


def test_queue_json_is_the_apis_answer(server: Server) -> None:
    result = ringmaster("queue", "--json", "--limit", "2", env=at(server))
    assert result.returncode == 0, result.stderr
    answer: dict[str, Any] = json.loads(result.stdout)
    assert [job["name"] for job in answer["items"]] == ["b-first", "a-waits"]
    assert answer["total"] == 3 and answer["limit"] == 2
    assert {tenant["name"]: tenant["weight"] for tenant in answer["tenants"]}["team-a"] == 3


def test_queue_with_the_server_away_fails_in_one_line(tmp_path: Path) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    result = ringmaster("queue", env={"RINGMASTER_API_URL": nowhere, "RINGMASTER_DATA_DIR": str(tmp_path)})
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 1 and "Traceback" not in output and len(output.splitlines()) == 1, output
    assert "cannot reach ringmaster" in output


def test_tenant_weight_is_set_kept_across_quota_changes_and_refused_out_of_range(server: Server) -> None:
    env = at(server)
    created = ringmaster("tenant", "create", "team-w", "--gpus", "2", "--weight", "2.5", env=env)
    assert created.returncode == 0 and "weight 2.5" in created.stdout, created.stdout + created.stderr
    changed = ringmaster("tenant", "quota", "team-w", "--gpus", "4", env=env)
    assert changed.returncode == 0 and "GPUs 4" in changed.stdout and "weight 2.5" in changed.stdout
    for bad in ("0", "1001"):
        refused = ringmaster("tenant", "quota", "team-w", "--weight", bad, env=env)
        output = (refused.stdout + refused.stderr).strip()
        assert refused.returncode == 1 and len(output.splitlines()) == 1 and "weight must be above 0" in output, output
    with session_scope(server.app.state.db.sessions) as session:
        tenant = session.get(Tenant, "team-w")
        assert tenant is not None and tenant.weight == 2.5 and tenant.quota_gpus == 4
    listed = ringmaster("tenant", "list", env=env)
    assert "2.5" in listed.stdout.splitlines()[_line_of(listed.stdout, "team-w")]


def test_drain_asks_for_the_node_with_its_deadline_and_an_unknown_node_fails_in_one_line(server: Server) -> None:
    before = time.time()
    drained = ringmaster("drain", DRAINABLE, "--deadline-s", "90", "--reason", "spot notice", env=at(server))
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert drained.stdout.startswith(f"node {DRAINABLE} drains by ") and "its jobs move off it" in drained.stdout
    [(node, deadline, reason)] = DRAINED
    assert (node, reason) == (DRAINABLE, "spot notice") and deadline is not None and deadline >= before + 90
    unknown = ringmaster("drain", "cd" * 28, env=at(server))
    output = (unknown.stdout + unknown.stderr).strip()
    assert unknown.returncode == 1 and len(output.splitlines()) == 1 and "no live Ray node has id" in output, output
    assert len(DRAINED) == 1
