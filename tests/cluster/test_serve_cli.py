"""`ringmaster serve` as a person runs it: it says where it listens (and the CLI finds it there), starts no Ray
client server, logs JSON lines when not on a terminal, and a head that cannot start is retried once, then reported in
one line with the cause and the log's path, leaving no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.ports import free_port
from tests.cli.test_cli_messages import REPO_ROOT, one_line_failure, ringmaster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _ray_processes() -> set[int]:
    """Processes of any Ray on this machine (raylet, GCS, dashboard, workers): their command lines name ray."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"ray" in command and (
                b"gcs_server" in command
                or b"raylet" in command
                or b"ray::" in command
                or b"dashboard" in command
                or b"ray start" in command
            ):
                found.add(int(entry))
    return found


def _left_behind(before: set[int], timeout_s: float = 15.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _ray_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


def test_serve_says_where_it_listens_runs_no_client_server_and_leaves_nothing(tmp_path: Path) -> None:
    before = _ray_processes()
    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("RINGMASTER_")}
    env.update({"RINGMASTER_DATA_DIR": str(tmp_path), "RINGMASTER_API_PORT": str(port)})
    serve = subprocess.Popen(
        [sys.executable, "-m", "ringmaster.cli", "serve"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address = tmp_path / "api-url"
        deadline = time.monotonic() + 120
        while not address.exists():
            assert serve.poll() is None, serve.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "serve never said where it listens"
            time.sleep(0.25)
        assert address.read_text().strip() == f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while (listed := ringmaster("status", env={"RINGMASTER_DATA_DIR": str(tmp_path)})).returncode != 0:
            assert time.monotonic() < deadline, listed.stdout + listed.stderr
            time.sleep(0.5)
        assert "name" in listed.stdout, "the CLI found the server through the data directory alone"
        assert not any(
            b"ray.util.client.server" in Path(f"/proc/{pid}/cmdline").read_bytes()
            for pid in _ray_processes() - before
            if Path(f"/proc/{pid}").exists()
        ), "a Ray client server runs"
    finally:
        serve.send_signal(signal.SIGINT)
        _, errors = serve.communicate(timeout=60)
    assert serve.returncode == 0, errors[-3000:]
    lines = [line for line in errors.splitlines() if line.strip()]
    assert lines and all(json.loads(line)["level"] for line in lines), "not on a terminal: JSON lines"
    assert not address.exists(), "a stopped server still says where it listened"
    assert not _left_behind(before), "the embedded head left processes behind"


def test_a_head_that_cannot_start_is_tried_twice_then_named_in_one_line(tmp_path: Path) -> None:
    before = _ray_processes()
    failed = ringmaster(
        "serve",
        env={
            "RINGMASTER_DATA_DIR": str(tmp_path),
            "RINGMASTER_API_PORT": str(free_port()),
            "RINGMASTER_RAY_START_TIMEOUT_S": "0.2",
        },
        timeout_s=180,
    )
    line = one_line_failure(failed)
    log_path = (tmp_path / "ray-head.log").resolve()
    assert line.startswith(
        "error: the embedded Ray head did not start (2 tries). Last: its dashboard did not answer within 0s: "
    ), line
    assert line.endswith(f"Its log: {log_path}"), line
    assert log_path.exists() and not (tmp_path / "ray-head.json").exists()
    assert not _left_behind(before), "a failed start left processes behind"
