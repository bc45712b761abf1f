"""Code and requirements travel with the job, end to end on a real local Ray: a directory uploaded over REST
becomes the Ray job's working_dir (a Ray package every node unpacks), a wheel built here is pip-installed into the
job's own runtime env, and what cannot start fails the job once with the reason.

The modules live only in temporary directories, outside the repository and RINGMASTER_CODE_PATH; the warm pool is
on (2 per node): a job with its own runtime env never takes a shared pool worker, and the next job in the env a job
ran in starts in that env's own pool."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from harness.local_control_plane import REPO_ROOT, running_control_plane, wait_for_state
from ringmaster.service.spec import SHARED_POOL, JobSpec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
STEPS = 4

MODEL = '''
    """A linear regression whose targets are scaled by VERSION: each job's copy says which one it trains."""
    import json
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import TensorDataset
    {imports}
    VERSION = {version}


    def _mse(model, batch):
        inputs, targets = batch
        return F.mse_loss(model(inputs), targets)


    def build(marker_dir: str):
        rank = dist.get_rank() if dist.is_initialized() else -1
        marker = {{"version": VERSION, "file": str(Path(__file__).resolve()), "cwd": os.getcwd(), "pid": os.getpid(),
                   "setting": os.environ.get("SHIPPED_SETTING"), {extra}}}
        Path(marker_dir, f"rank-{{rank}}.json").write_text(json.dumps(marker))
        inputs = torch.randn(32, 3, generator=torch.Generator().manual_seed(0))
        return nn.Linear(3, 1), TensorDataset(inputs, inputs.sum(1, keepdim=True) * VERSION), _mse
'''


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory: pytest.TempPathFactory):
    """conftest's cluster, whose runtime env agent tries a failing setup once: by default Ray tries it 3 times (each a
    copy of the whole virtualenv, minutes on a small machine) before the job fails, which ringmaster then fails once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RUNTIME_ENV_RETRY_TIMES", "1")
        yield from running_control_plane(tmp_path_factory.mktemp("ringmaster"), warm_runtime_envs=1)


def _project(root: Path, version: int, imports: str = "", extra: str = "") -> Path:
    root.mkdir(parents=True)
    (root / "shipped_model.py").write_text(
        textwrap.dedent(MODEL.format(version=version, imports=imports, extra=extra)).lstrip()
    )
    (root / "notes.log").write_text("left out by .gitignore")
    (root / ".gitignore").write_text("*.log\n")
    assert not root.resolve().is_relative_to(REPO_ROOT), "the project must lie outside every code path"
    return root


def _spec(name: str, markers: Path, **fields: Any) -> dict[str, Any]:
    markers.mkdir(parents=True, exist_ok=True)
    return {
        "name": name,
        "model": "shipped_model:build",
        "data": "user",
        "model_options": {"marker_dir": str(markers)},
        "workers": {"min": 2, "max": 2, "cpus_per_worker": 1},
        "train": {"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 4, "lr": 0.01},
        **fields,
    }


def _markers(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(directory.glob("rank-*.json"))]


def _wait_for_warm_pool(count: int, pool: str = SHARED_POOL, timeout_s: float = 180.0) -> None:
    """Until `count` idle workers of `pool` are warm: a job that could take them is offered them."""
    from ringmaster.workers.warm_pool import pool_by_node, pool_statuses

    def idle_and_warm() -> int:
        names = [name for names in pool_by_node(pool).values() for name in names]
        return sum(status["warm"] and status["claimant"] is None for _, status in pool_statuses(names).values())

    deadline = time.monotonic() + timeout_s
    while idle_and_warm() < count:
        assert time.monotonic() < deadline, f"fewer than {count} warm workers in pool {pool} after {timeout_s:.0f}s"
        time.sleep(0.5)


def _running_event(client, job_id: str) -> dict[str, Any]:
    return next(event for event in client.events(job_id)["items"] if event["to_state"] == "RUNNING")


def test_two_jobs_shipping_their_own_version_of_one_module_each_train_it_on_two_workers(
    ray_server, tmp_path: Path
) -> None:
    client = ray_server.client()
    _wait_for_warm_pool(2)
    jobs = {}
    for version in (1, 2):
        project = _project(tmp_path / f"project-v{version}", version)
        jobs[version] = client.submit(
            _spec(f"shipped-v{version}", tmp_path / f"markers-v{version}", max_failures=0), code=project
        )
    assert jobs[1]["spec"]["code"] != jobs[2]["spec"]["code"]
    for version, job in jobs.items():
        done = wait_for_state(client, job["id"], TERMINAL)
        assert done["state"] == "SUCCEEDED", done["error"]
        markers = _markers(tmp_path / f"markers-v{version}")
        assert len(markers) == 2 and {marker["version"] for marker in markers} == {version}
        for marker in markers:
            shipped = Path(marker["file"])
            # Imported from Ray's unpacked copy of the job's package, which is also the worker's working directory.
            assert shipped.parent.name.startswith("_ray_pkg_") and shipped.parent == Path(marker["cwd"]).resolve()
            assert not shipped.is_relative_to(tmp_path) and not shipped.is_relative_to(REPO_ROOT)
            assert not (shipped.parent / "notes.log").exists(), ".gitignore'd files are not shipped"
        assert _running_event(client, job["id"])["data"]["warm_pool_workers"] == 0, (
            "no shared pool worker runs shipped code"
        )
        rows = client.metrics(job["id"])["items"]
        assert [row["step"] for row in rows] == list(range(1, STEPS + 1)) and {row["world_size"] for row in rows} == {2}

    # v2 ran last: its env now has a warm pool of its own, which the next v2 job takes, still training its own code.
    _wait_for_warm_pool(2, pool=JobSpec.model_validate(jobs[2]["spec"]).warm_pool)
    again = client.submit(
        _spec("shipped-v2-again", tmp_path / "markers-v2-again", max_failures=0), code=tmp_path / "project-v2"
    )
    assert again["spec"]["code"] == jobs[2]["spec"]["code"]
    done = wait_for_state(client, again["id"], TERMINAL)
    assert done["state"] == "SUCCEEDED", done["error"]
    assert _running_event(client, again["id"])["data"]["warm_pool_workers"] == 2
    markers = _markers(tmp_path / "markers-v2-again")
    assert len(markers) == 2 and {marker["version"] for marker in markers} == {2}
    assert all(Path(marker["file"]).parent.name.startswith("_ray_pkg_") for marker in markers)


def test_an_import_error_in_the_users_module_fails_the_job_once_naming_the_import_and_where(
    ray_server, tmp_path: Path
) -> None:
    client = ray_server.client()
    project = _project(tmp_path / "broken", 1, imports="import a_module_nobody_installed")
    job = client.submit(_spec("shipped-broken", tmp_path / "markers", max_failures=2), code=project)
    done = wait_for_state(client, job["id"], TERMINAL)
    assert (done["state"], done["attempt"]) == ("FAILED", 1), done["error"]
    line = next(
        number
        for number, text in enumerate((project / "shipped_model.py").read_text().splitlines(), 1)
        if text == "import a_module_nobody_installed"
    )
    assert re.fullmatch(
        r"model entrypoint 'shipped_model:build': cannot import module 'shipped_model': "
        r"ModuleNotFoundError: No module named 'a_module_nobody_installed' "
        rf"\(at /\S+/_ray_pkg_\w+/shipped_model\.py:{line}\)",
        done["error"],
    ), done["error"]


def test_a_driver_that_cannot_start_fails_the_job_once_with_its_traceback(ray_server, tmp_path: Path) -> None:
    client = ray_server.client()
    project = _project(tmp_path / "shadowing", 1)
    (project / "ringmaster").mkdir()  # shadows ringmaster itself on the driver's path: its entrypoint cannot import
    (project / "ringmaster" / "__init__.py").write_text('raise ImportError("this tree brings its own ringmaster")\n')
    job = client.submit(_spec("shipped-no-driver", tmp_path / "markers", max_failures=2), code=project)
    done = wait_for_state(client, job["id"], TERMINAL)
    assert (done["state"], done["attempt"]) == ("FAILED", 1), done["error"]
    assert done["error"].startswith(
        "attempt 1: the job's driver never started: Job entrypoint command failed with exit code 1"
    )
    assert "ImportError: this tree brings its own ringmaster" in done["error"]
    assert [event["to_state"] for event in client.events(job["id"])["items"] if event["to_state"]] == [
        "QUEUED",
        "ADMITTED",
        "FAILED",
    ]


def test_a_failed_pip_install_fails_the_job_once_with_pips_message(ray_server, tmp_path: Path) -> None:
    client = ray_server.client()
    runtime_env = {"pip": ["ringmaster-no-such-distribution==9.9.9"]}
    job = client.submit(
        _spec("shipped-bad-pip", tmp_path / "markers", max_failures=2, runtime_env=runtime_env),
        code=_project(tmp_path / "bad-pip", 1),
    )
    done = wait_for_state(client, job["id"], TERMINAL, timeout_s=420)
    assert (done["state"], done["attempt"]) == ("FAILED", 1), done["error"]
    assert done["error"] == (
        "attempt 1: the job's driver never started: its runtime env could not be set up: pip install "
        "failed: Could not find a version that satisfies the requirement "
        "ringmaster-no-such-distribution==9.9.9 (from versions: none); No matching distribution found "
        "for ringmaster-no-such-distribution==9.9.9"
    )


def _wheel(tmp_path: Path) -> Path:
    """A wheel of a one-module distribution, built here without an index."""
    source = tmp_path / "tinydep-src"
    (source / "ringmaster_tinydep").mkdir(parents=True)
    (source / "ringmaster_tinydep" / "__init__.py").write_text('VALUE = "from the wheel"\n')
    (source / "pyproject.toml").write_text(
        textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "ringmaster-tinydep"
        version = "0.1"

        [tool.setuptools]
        packages = ["ringmaster_tinydep"]
    """)
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path / "wheels"),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    [wheel] = (tmp_path / "wheels").glob("ringmaster_tinydep-0.1-*.whl")
    return wheel


def test_a_requirement_from_a_local_wheel_is_importable_in_every_worker(ray_server, tmp_path: Path) -> None:
    client = ray_server.client()
    wheel = _wheel(tmp_path)
    project = _project(
        tmp_path / "with-dep",
        3,
        imports="import ringmaster_tinydep",
        extra='"dep": ringmaster_tinydep.VALUE, "dep_file": ringmaster_tinydep.__file__',
    )
    runtime_env = {"pip": [f"ringmaster-tinydep @ {wheel.as_uri()}"], "env_vars": {"SHIPPED_SETTING": "on"}}
    job = client.submit(
        _spec("shipped-with-dep", tmp_path / "markers", max_failures=0, runtime_env=runtime_env), code=project
    )
    done = wait_for_state(client, job["id"], TERMINAL, timeout_s=420)
    assert done["state"] == "SUCCEEDED", done["error"]
    markers = _markers(tmp_path / "markers")
    assert len(markers) == 2
    for marker in markers:
        assert (marker["dep"], marker["setting"], marker["version"]) == ("from the wheel", "on", 3)
        assert "site-packages" in marker["dep_file"] and not marker["dep_file"].startswith(sys.prefix), (
            "installed into the job's own environment, not the cluster's"
        )
