"""A job's own code and runtime env up to the cluster's door: packing a directory, POST /v1/code on both databases
(content-addressed per tenant, 413 over RINGMASTER_MAX_CODE_BYTES, nothing half-written), the JobSpec's `code` and
`runtime_env` checked at submit, the runtime_env the dispatcher hands Ray, and a driver that never started failing
its job once instead of being resubmitted."""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from typer.testing import CliRunner

from ringmaster.api.app import create_app
from ringmaster.cli import app as cli
from ringmaster.service import code_store, jobs
from ringmaster.service.code_packing import CodeDirectoryError, files_to_pack, pack_directory
from ringmaster.service.db import Database, session_scope
from ringmaster.service.dispatcher import Dispatcher
from ringmaster.service.errors import CodeTooLarge
from ringmaster.service.models import DEFAULT_TENANT, CodeArchive, Job
from ringmaster.service.ray_cluster import runtime_env_failure_reason
from ringmaster.service.reports import DriverReport
from ringmaster.service.settings import Settings, get_settings
from ringmaster.service.spec import JobSpec
from tests.service.test_dispatcher import FakeCluster
from tests.support.api_tokens import mint

LIMIT = 64 * 1024
SPEC = {
    "name": "shipped",
    "model": "shipped_model:build",
    "data": "synthetic",
    "workers": {"min": 1, "max": 1},
    "train": {"global_batch_size": 4, "micro_batch_size": 4},
}


def _tree(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _zip(entries: dict[str, bytes]) -> bytes:
    """The same bytes whenever it is built: a parameter's test id holds them, and every pytest-xdist worker must
    collect the same ids (writestr by name would stamp each entry with the time of collection)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0)), data, zipfile.ZIP_DEFLATED)
    return buffer.getvalue()


# --- packing -------------------------------------------------------------------------------------------------------


def test_packing_honours_gitignore_and_ringmasterignore_and_leaves_out_git_caches_and_venvs(tmp_path: Path) -> None:
    root = _tree(
        tmp_path / "project",
        {
            "model.py": "x = 1\n",
            "pkg/__init__.py": "",
            "pkg/data.csv": "1,2\n",
            "pkg/.gitignore": "*.csv\n",
            ".gitignore": "build/\n*.log\n!keep.log\n",
            ".ringmasterignore": "notes/\n",
            "build/out.py": "",
            "run.log": "",
            "keep.log": "kept",
            "notes/todo.md": "",
            ".git/HEAD": "ref",
            "pkg/__pycache__/m.cpython-311.pyc": "",
            ".venv/bin/python": "",
        },
    )
    packed = [name for name, _ in files_to_pack(root)]
    assert packed == [".gitignore", ".ringmasterignore", "keep.log", "model.py", "pkg/.gitignore", "pkg/__init__.py"]


def test_packing_the_same_files_again_gives_the_same_archive(tmp_path: Path) -> None:
    root = _tree(tmp_path / "project", {"b.py": "b = 2\n", "a/m.py": "a = 1\n"})
    first = pack_directory(root, LIMIT)
    os.utime(root / "b.py", (1_000_000, 1_000_000))  # a touched file: same content, same archive
    second = pack_directory(root, LIMIT)
    assert first.ref == second.ref and first.ref == f"sha256:{hashlib.sha256(first.content).hexdigest()}"
    assert zipfile.ZipFile(io.BytesIO(first.content)).namelist() == ["a/m.py", "b.py"]
    (root / "b.py").write_text("b = 3\n")
    assert pack_directory(root, LIMIT).ref != first.ref


def test_packing_more_than_the_limit_names_the_setting(tmp_path: Path) -> None:
    root = _tree(tmp_path / "big", {"weights.bin": "0" * (LIMIT + 1)})
    with pytest.raises(CodeTooLarge, match="RINGMASTER_MAX_CODE_BYTES"):
        pack_directory(root, LIMIT)
    (root / ".ringmasterignore").write_text("*.bin\n")
    with pytest.raises(CodeDirectoryError, match="no files"):
        pack_directory(_tree(tmp_path / "empty", {".git/HEAD": "ref"}), LIMIT)
    assert [name for name, _ in files_to_pack(root)] == [".ringmasterignore"]


# --- POST /v1/code and submit ----------------------------------------------------------------------------------------


class Api:
    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.db: Database = client.app.state.db  # type: ignore[attr-defined]
        self.tokens = {"a": mint(client.app, "team-a"), "b": mint(client.app, "team-b")}  # type: ignore[arg-type]

    def call(self, who: str, method: str, path: str, **kwargs: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.tokens[who]}", **kwargs.pop("headers", {})}
        return self.client.request(method, path, headers=headers, **kwargs)

    def upload(self, who: str, content: bytes, content_type: str = "application/zip") -> Any:
        return self.call(who, "POST", "/v1/code", content=content, headers={"Content-Type": content_type})

    def archives(self) -> int:
        with self.db.sessions() as session:
            return session.scalar(select(func.count()).select_from(CodeArchive)) or 0


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    with TestClient(create_app(Settings(database_url=db_url, data_dir=tmp_path, max_code_bytes=LIMIT))) as client:
        yield Api(client)


def test_an_upload_is_stored_once_per_tenant_and_a_spec_naming_it_is_queued(api: Api, tmp_path: Path) -> None:
    packed = pack_directory(_tree(tmp_path / "project", {"shipped_model.py": "def build(): ...\n"}), LIMIT)
    first = api.upload("a", packed.content)
    assert first.status_code == 201, first.text
    assert first.json()["code"] == packed.ref and first.json()["files"] == 1
    again = api.upload("a", packed.content)
    assert (again.status_code, again.json()["code"]) == (200, packed.ref)
    assert api.call("a", "GET", f"/v1/code/{packed.ref}").json()["size_bytes"] == len(packed.content)
    assert api.archives() == 1

    job = api.call(
        "a",
        "POST",
        "/v1/jobs",
        json={**SPEC, "code": packed.ref, "runtime_env": {"pip": ["tinydep==1.0"], "env_vars": {"MODE": "x"}}},
    )
    assert job.status_code == 201, job.text
    assert job.json()["spec"]["code"] == packed.ref and job.json()["spec"]["runtime_env"]["env_vars"] == {"MODE": "x"}


def test_a_missing_or_another_tenants_code_hash_is_refused_at_submit(api: Api, tmp_path: Path) -> None:
    packed = pack_directory(_tree(tmp_path / "project", {"shipped_model.py": "def build(): ...\n"}), LIMIT)
    assert api.upload("a", packed.content).status_code == 201
    missing = "sha256:" + "0" * 64
    for ref in (missing, packed.ref):
        response = api.call("b", "POST", "/v1/jobs", json={**SPEC, "code": ref})
        assert response.status_code == 422, response.text
        [error] = response.json()["detail"]
        assert error["field"] == "code"
        assert error["msg"] == (
            f"no code archive {ref} for tenant 'team-b': upload it first "
            "(POST /v1/code, or `ringmaster submit --code DIR`)"
        )
    assert api.call("b", "GET", f"/v1/code/{packed.ref}").status_code == 404, (
        "another tenant's archive reads as unknown"
    )
    malformed = api.call("a", "POST", "/v1/jobs", json={**SPEC, "code": "abc123"})
    assert malformed.status_code == 422 and malformed.json()["detail"][0]["field"] == "code"
    with api.db.sessions() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0, "no refused submit wrote a job"


def test_an_oversized_archive_is_413_naming_the_limit_and_nothing_is_stored(api: Api) -> None:
    too_big = os.urandom(LIMIT + 1)
    response = api.upload("a", too_big)
    assert response.status_code == 413
    assert (
        response.json()["detail"] == f"the request body exceeds the limit of {LIMIT} bytes (RINGMASTER_MAX_CODE_BYTES)"
    )
    # Small packed, large unpacked: refused by what it would take on every node.
    bomb = _zip({"zeros.bin": b"\0" * (LIMIT * 4)})
    assert len(bomb) < LIMIT
    response = api.upload("a", bomb)
    assert response.status_code == 413
    assert response.json()["detail"] == (
        f"the code archive unpacked is {LIMIT * 4} bytes, over the limit of {LIMIT} bytes (RINGMASTER_MAX_CODE_BYTES)"
    )
    assert api.archives() == 0


@pytest.mark.parametrize(
    ("content", "content_type", "status", "message"),
    [
        (b"not a zip at all", "application/zip", 422, "not a zip archive"),
        (_zip({"../escape.py": b"x = 1"}), "application/zip", 422, "every path must be relative"),
        (_zip({"/etc/cron.d/x": b"x"}), "application/zip", 422, "every path must be relative"),
        (_zip({}), "application/zip", 422, "holds no files"),
        (_zip({"m.py": b"x"}), "text/plain", 415, "application/zip"),
    ],
)
def test_an_upload_that_is_not_a_safe_zip_is_refused_with_the_reason(
    api: Api, content: bytes, content_type: str, status: int, message: str
) -> None:
    response = api.upload("a", content, content_type)
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert message in (detail if isinstance(detail, str) else detail[0]["msg"])
    assert api.archives() == 0


@pytest.mark.parametrize(
    ("runtime_env", "field", "message"),
    [
        ({"pip": ["numpy>=1 ; ;"]}, "runtime_env.pip", "is not a requirement"),
        ({"pip": ["--index-url http://elsewhere"]}, "runtime_env.pip", "is not a requirement"),
        ({"pip": ["x" * 1001]}, "runtime_env.pip", "at most 1000 characters"),
        ({"pip": [f"pkg{i}" for i in range(101)]}, "runtime_env.pip", "at most 100"),
        ({"env_vars": {"RINGMASTER_REPORT_TOKEN": "mine"}}, "runtime_env.env_vars", "is reserved"),
        ({"env_vars": {"1BAD": "x"}}, "runtime_env.env_vars", "is not a variable name"),
        ({"env_vars": {"BIG": "x" * (32 * 1024 + 1)}}, "runtime_env.env_vars", "at most 32768"),
        ({"conda": "env.yaml"}, "runtime_env.conda", "Extra inputs"),
    ],
)
def test_a_bad_runtime_env_is_422_naming_the_field(
    api: Api, runtime_env: dict[str, Any], field: str, message: str
) -> None:
    response = api.call("a", "POST", "/v1/jobs", json={**SPEC, "runtime_env": runtime_env})
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["field"] == field and message in error["msg"], error


def test_spec_hash_leaves_out_code_and_runtime_env_only_when_unset() -> None:
    plain = JobSpec.model_validate(SPEC)
    assert JobSpec.model_validate({**SPEC, "code": None, "runtime_env": None}).spec_hash() == plain.spec_hash()
    assert JobSpec.model_validate({**SPEC, "code": "sha256:" + "1" * 64}).spec_hash() != plain.spec_hash()
    assert JobSpec.model_validate({**SPEC, "runtime_env": {"pip": ["a"]}}).spec_hash() != plain.spec_hash()
    assert not plain.has_own_runtime_env and JobSpec.model_validate({**SPEC, "runtime_env": {}}).has_own_runtime_env


# --- dispatch and reconcile ------------------------------------------------------------------------------------------


@pytest.fixture
def dispatched(db: Database, tmp_path: Path) -> tuple[Dispatcher, FakeCluster, str]:
    """A dispatcher on a fake cluster, and the default tenant's archive of a one-module project."""
    cluster = FakeCluster(cpus=4)
    settings = Settings(api_url="http://cp", storage_uri="/ckpt", data_dir=tmp_path / "data", code_path="/cluster/code")
    packed = pack_directory(_tree(tmp_path / "project", {"shipped_model.py": "def build(): ...\n"}), LIMIT)
    with session_scope(db.sessions) as session:
        code_store.store_archive(session, DEFAULT_TENANT, packed.content, LIMIT)
    return Dispatcher(db.sessions, cluster, settings, owner="code-test"), cluster, packed.ref


def _submit(db: Database, **fields: Any) -> str:
    with session_scope(db.sessions) as session:
        return jobs.submit_job(session, JobSpec.model_validate({**SPEC, **fields})).id


def test_the_ray_job_gets_the_code_as_working_dir_and_the_specs_runtime_env(db: Database, dispatched) -> None:
    dispatcher, cluster, ref = dispatched
    job_id = _submit(
        db,
        code=ref,
        max_failures=2,
        runtime_env={
            "pip": ["tinydep @ file:///wheels/tinydep-0.1-py3-none-any.whl"],
            "env_vars": {"MODE": "fast", "PYTHONPATH": "/mine"},
        },
    )
    dispatcher.run_once()
    runtime_env = cluster.runtime_envs[f"ringmaster-{job_id}-1"]
    working_dir = Path(runtime_env["working_dir"])
    assert working_dir.suffix == ".zip" and f"sha256:{hashlib.sha256(working_dir.read_bytes()).hexdigest()}" == ref
    assert runtime_env["pip"] == ["tinydep @ file:///wheels/tinydep-0.1-py3-none-any.whl"]
    env_vars = runtime_env["env_vars"]
    assert env_vars["MODE"] == "fast" and env_vars["PYTHONPATH"] == f"/mine{os.pathsep}/cluster/code"
    assert not any(name.startswith("RINGMASTER_") for name in env_vars), "the driver's secret is in its handoff"

    # A later attempt, on a dispatcher whose local copy is gone, finds the archive in the database.
    working_dir.unlink()
    cluster.ray_status[f"ringmaster-{job_id}-1"] = "FAILED"  # lost after it ran: no start failure
    dispatcher.run_once()
    second = cluster.runtime_envs[f"ringmaster-{job_id}-2"]
    assert Path(second["working_dir"]).read_bytes() and second["working_dir"] == str(working_dir)


def test_a_plain_spec_gets_no_working_dir_nor_pip(db: Database, dispatched) -> None:
    dispatcher, cluster, _ = dispatched
    job_id = _submit(db)
    dispatcher.run_once()
    runtime_env = cluster.runtime_envs[f"ringmaster-{job_id}-1"]
    assert set(runtime_env) == {"env_vars"} and runtime_env["env_vars"]["PYTHONPATH"] == "/cluster/code"


def test_a_driver_that_never_started_fails_its_job_once_with_the_reason(db: Database, dispatched) -> None:
    dispatcher, cluster, ref = dispatched
    job_id = _submit(db, code=ref, max_failures=3, runtime_env={"pip": ["no-such-dist==9"]})
    dispatcher.run_once()
    submission = f"ringmaster-{job_id}-1"
    cluster.ray_status[submission] = "FAILED"
    cluster.start_failures[submission] = (
        "its runtime env could not be set up: ERROR: No matching distribution found for no-such-dist==9"
    )
    dispatcher.run_once()
    with db.sessions() as session:
        job = session.get(Job, job_id)
        assert (job.state, job.attempt) == ("FAILED", 1), "not resubmitted: every attempt would fail the same way"
        assert job.error == (
            "attempt 1: the job's driver never started: its runtime env could not be set up: "
            "ERROR: No matching distribution found for no-such-dist==9"
        )
    assert list(cluster.submitted) == [submission]
    dispatcher.run_once()
    assert cluster.stopped == [submission] and cluster.free_cpus == 4, "its placement group is released"


# Ray 2.58's account of a failed pip install (JobInfo.message), as a trial job got it; the paths shortened.
RAY_PIP_FAILURE = """runtime_env setup failed: Failed to set up runtime environment.
Could not create the actor because its associated runtime env failed to be created.
[Node 192.0.2.2] Traceback (most recent call last):
  File "/ray/_private/runtime_env/agent/runtime_env_agent.py", line 408, in _create_runtime_env_with_retry
    runtime_env_context = await asyncio.wait_for(
                          ^^^^^^^^^^^^^^^^^^^^^^^
  File "/ray/_private/runtime_env/utils.py", line 105, in check_output_cmd
    raise SubprocessCalledProcessError(
ray._private.runtime_env.utils.SubprocessCalledProcessError: Run cmd[9] failed with the following details.
Command '['/pip/virtualenv/bin/python', '-m', 'pip', 'install', '-r', '/pip/requirements.txt']' returned non-zero exit status 1.
Last 50 lines of stdout:
    Looking in indexes: https://pypi.org/simple
    WARNING: Location 'file:///opt/pypi/simple/no-such-dist/' is ignored: it is neither a file nor a directory.
    ERROR: Could not find a version that satisfies the requirement no-such-dist==9 (from versions: none)
    ERROR: No matching distribution found for no-such-dist==9
"""  # noqa: E501 (Ray's message verbatim)


def test_a_failed_pip_install_is_told_by_pips_errors_not_rays_traceback() -> None:
    assert runtime_env_failure_reason(RAY_PIP_FAILURE) == (
        "pip install failed: Could not find a version that satisfies the requirement no-such-dist==9 (from versions: "
        "none); No matching distribution found for no-such-dist==9"
    )


def test_another_runtime_env_failure_is_told_by_the_exception_rays_traceback_ends_in() -> None:
    message = RAY_PIP_FAILURE.split("Last 50 lines")[0].replace(
        "ray._private.runtime_env.utils.SubprocessCalledProcessError: Run cmd[9] failed with the following details.",
        "ValueError: working_dir 'gcs://_ray_pkg_0.zip' is not in the package store",
    )
    assert (
        runtime_env_failure_reason(message)
        == "ValueError: working_dir 'gcs://_ray_pkg_0.zip' is not in the package store"
    )
    assert runtime_env_failure_reason("the agent is gone") == "the agent is gone"


def test_a_driver_lost_after_it_reported_is_resubmitted_even_if_ray_calls_it_a_start_failure(
    db: Database, dispatched
) -> None:
    dispatcher, cluster, _ = dispatched
    job_id = _submit(db, max_failures=3)
    dispatcher.run_once()
    submission = f"ringmaster-{job_id}-1"
    with session_scope(db.sessions) as session:
        jobs.apply_driver_report(session, job_id, 1, DriverReport(seq=1, state="RUNNING"))
    with session_scope(db.sessions) as session:  # quiet since: the reconciler asks Ray
        attempt = session.scalars(select(jobs.Attempt).where(jobs.Attempt.job_id == job_id)).one()
        attempt.last_report_at = attempt.last_report_at.replace(year=2000)
    cluster.ray_status[submission] = "FAILED"
    cluster.start_failures[submission] = "Job entrypoint command failed with exit code 1"
    dispatcher.run_once()
    with db.sessions() as session:
        job = session.get(Job, job_id)
        assert (job.state, job.attempt, job.failures) == ("ADMITTED", 2, 1)


# --- CLI -----------------------------------------------------------------------------------------------------------


def test_cli_submit_with_code_over_the_limit_is_one_line_and_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: shipped\nmodel: shipped_model:build\n")
    project = _tree(tmp_path / "project", {"weights.bin": "0" * 4096})
    monkeypatch.setenv("RINGMASTER_MAX_CODE_BYTES", "2048")
    monkeypatch.setenv("RINGMASTER_DATA_DIR", str(tmp_path / "data"))
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(cli.app, ["submit", str(spec), "--code", str(project)])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines == [
        f"error: the code in {project.resolve()} (unpacked) is 4096 bytes, over the limit of 2048 bytes "
        "(RINGMASTER_MAX_CODE_BYTES); leave out what the job need not ship with a .ringmasterignore"
    ]
    assert "Traceback" not in result.output
    missing = CliRunner().invoke(
        cli.app, ["submit", str(spec), "--code", str(tmp_path / "nowhere")], env={"COLUMNS": "300"}
    )
    assert (
        missing.exit_code == 2 and "Invalid value for '--code'" in missing.output and "does not exist" in missing.output
    )
