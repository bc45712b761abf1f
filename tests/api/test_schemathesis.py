"""Property-based, with schemathesis's own runner (its CLI, as a user would run it): every operation of the OpenAPI
schema, fed generated input in every phase (examples, coverage, fuzzing, stateful), held to every check, with an
admin's token and with a tenant's, on both databases. On PostgreSQL the coverage phase (the schema's boundary cases,
two thirds of a run's time) is left to SQLite's run: the same server code answers them, and fuzzing reaches
PostgreSQL's own limits (NUL, 64-bit integers) there too.

One check is read more strictly than schemathesis's own positive_data_acceptance
(tests/support/schemathesis_hooks.py): a request the schema allows is accepted, or refused only for a rule no JSON
Schema can state, and the refusal names its field. A refused negative request may also be a 413 (a body over the size
limit is refused before it is read).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from harness.ports import free_port
from ringmaster.api.app import create_app
from ringmaster.service.auth import Principal, new_report_token
from ringmaster.service.db import session_scope
from ringmaster.service.jobs import cancel_job, get_job, mark_admitted, submit_job
from ringmaster.service.settings import Settings
from ringmaster.service.spec import JobSpec
from tests.support.api_tokens import mint

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # schemathesis_hooks.py, which the CLI imports by name
# With the coverage phase (SQLite), and without it (PostgreSQL, where fuzzing draws more examples instead): examples
# per operation, and the fewest requests a run must have generated to count as having tested the API.
WITH_COVERAGE = (15, 1000)
WITHOUT_COVERAGE = (30, 500)
CONFIG = """
[checks.negative_data_rejection]
expected-statuses = [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429]

[parameters]
"path.job_id" = "{job_id}"
"""


@dataclass
class LiveApi:
    url: str
    app: FastAPI


@pytest.fixture
def live_api(db_url: str, tmp_path: Path) -> Iterator[LiveApi]:
    app = create_app(Settings(database_url=db_url, data_dir=tmp_path))
    app.state.stream_poll_s = 0.01
    app.state.logs_provider = lambda submission_id: f"log of {submission_id}\n"
    app.state.node_drainer = lambda node_id, deadline, reason: None  # every node exists and drains
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the API server did not start"
        time.sleep(0.05)
    try:
        yield LiveApi(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _seed_jobs(app: FastAPI, principal: Principal) -> str:
    """A queued, an admitted and a cancelled job of the principal's tenant; the cancelled one's id, which the run's
    job routes are pointed at (a stream ends only with its job)."""
    spec = JobSpec.model_validate({"name": "seeded", "model": "mlp"})
    with session_scope(app.state.db.sessions) as session:
        submit_job(session, spec, principal=principal)
        admitted, cancelled = (
            submit_job(session, spec, principal=principal),
            submit_job(session, spec, principal=principal),
        )
        mark_admitted(
            session,
            get_job(session, admitted.id),
            1,
            f"ringmaster-{admitted.id}-1",
            None,
            1,
            report_token_hash=new_report_token()[1],
        )
        cancel_job(session, cancelled.id)
        return cancelled.id


def _start_run(
    api: LiveApi, tenant: str, admin: bool, folder: Path, phases: str, examples: int
) -> subprocess.Popen[str]:
    """Schemathesis's CLI against the API with a new token of the tenant, in the background."""
    folder.mkdir()
    token = mint(api.app, tenant, admin=admin)
    config = folder / "schemathesis.toml"
    config.write_text(CONFIG.format(job_id=_seed_jobs(api.app, Principal(tenant, admin=admin))))
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "--config-file",
            str(config),
            "--no-color",
            "run",
            f"{api.url}/openapi.json",
            "--header",
            f"Authorization: Bearer {token}",
            "--phases",
            phases,
            "--checks",
            "all",
            "--exclude-checks",
            "positive_data_acceptance",
            "--max-examples",
            str(examples),
            "--seed",
            "1",
            "--request-timeout",
            "20",
            "--workers",
            "1",
        ],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_every_check_holds_on_every_operation_for_an_admin_and_a_tenant(
    live_api: LiveApi, db_url: str, tmp_path: Path
) -> None:
    """The two runs go side by side against one server (as two clients would); each reports on its own."""
    on_postgres = db_url.startswith("postgresql")
    phases = ["examples", "fuzzing", "stateful"] if on_postgres else ["examples", "coverage", "fuzzing", "stateful"]
    examples, fewest = WITHOUT_COVERAGE if on_postgres else WITH_COVERAGE
    runs = {
        "admin": _start_run(live_api, "fuzz-admin", True, tmp_path / "admin", ",".join(phases), examples),
        "tenant": _start_run(live_api, "team-a", False, tmp_path / "tenant", ",".join(phases), examples),
    }
    outputs = {}
    try:
        for role, run in runs.items():
            outputs[role] = run.communicate(timeout=400)[0]
    finally:
        for run in runs.values():
            run.kill()
    for role, run in runs.items():
        output = outputs[role]
        assert run.returncode == 0, f"as {role}:\n{output[-12000:]}"
        generated = re.search(r"(\d+) generated", output)
        assert generated and int(generated.group(1)) >= fewest, f"as {role}:\n{output[-3000:]}"
        assert all(phase.capitalize() in output for phase in phases[1:]), f"as {role}:\n{output[-3000:]}"
