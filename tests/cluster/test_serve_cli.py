"""`ringmaster serve` as a person runs it: it says where it listens (and the CLI finds it there), starts no Ray
client server, logs JSON lines when not on a terminal; SIGTERM, SIGINT and `ringmaster stop` each end it and every
process it started (its embedded Ray head, the head's workers in process groups of their own) within its grace
period; a server started after a kill -9 adopts the Ray head the dead one left, so a data directory never has two;
a head that cannot start is retried once, then reported in one line with the cause and the log's path, leaving no
process behind."""

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
from ringmaster.service.embedded_ray import start_head, stop_head
from tests.cli.test_cli_messages import REPO_ROOT, one_line_failure, ringmaster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STOP_GRACE_S = 10.0  # Settings.stop_grace_s's default, which these servers run with
LEFT_AFTER_S = 15.0  # how long after the stop began no process of the server's tree may be left


def _ray_processes(data_dir: Path) -> set[int]:
    """Ray's processes (raylet, GCS, dashboard, workers: their command lines name ray) that a `serve` on data_dir
    started: they inherit the RINGMASTER_DATA_DIR it was given (other tests may run Ray heads of their own)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                command = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
                environment = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if (
                b"ray" in command
                and (
                    b"gcs_server" in command
                    or b"raylet" in command
                    or b"ray::" in command
                    or b"dashboard" in command
                    or b"ray start" in command
                )
                and f"RINGMASTER_DATA_DIR={data_dir}".encode() in environment
            ):
                found.add(int(entry))
    return found


def _left_behind(data_dir: Path, timeout_s: float = 15.0) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _ray_processes(data_dir)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


# -- a process tree, read from /proc independently of the code under test -------------------------------------------


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent, start time, state) of a process; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19]), fields[0]


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _tree(root: int) -> dict[int, int]:
    """pid -> start time of every live process below root by parent links: Ray's workers sit in process groups of
    their own, and job drivers in sessions of their own, but each is still its starter's child."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (found := _stat(int(entry))) is not None:
            children.setdefault(found[0], []).append(int(entry))
    tree: dict[int, int] = {}
    frontier = [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if (found := _stat(child)) is not None and child not in tree:
                tree[child] = found[1]
                frontier.append(child)
    return tree


def _alive(tree: dict[int, int]) -> set[int]:
    """The processes of tree still running (the same ones: a pid the kernel gave another process since is not)."""
    return {pid for pid, started in tree.items() if (found := _stat(pid)) and found[1] == started and found[2] != "Z"}


def _alive_until(tree: dict[int, int], deadline: float) -> set[int]:
    while (alive := _alive(tree)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return alive


def _described(pids: set[int]) -> list[str]:
    return [f"{pid} {_command(pid)[:120]}" for pid in sorted(pids)]


def _kill(pids: set[int]) -> None:
    """What a failed test left: these processes, each by its pid."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- `ringmaster serve` in a process of its own -----------------------------------------------------------------------


def _serve(data_dir: Path) -> subprocess.Popen[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("RINGMASTER_")}
    env.update({"RINGMASTER_DATA_DIR": str(data_dir), "RINGMASTER_API_PORT": str(free_port())})
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir.parent / f"{data_dir.name}-serve.log", "a") as log:  # a file, never a pipe nobody reads
        return subprocess.Popen(
            [sys.executable, "-m", "ringmaster.cli", "serve"],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )


def _log(data_dir: Path) -> str:
    return (data_dir.parent / f"{data_dir.name}-serve.log").read_text(errors="replace")


def _wait_serving(serve: subprocess.Popen[str], data_dir: Path) -> str:
    """Once the CLI, given only the data directory, finds the server and it answers: `ringmaster status`'s output."""
    deadline = time.monotonic() + 180
    while (listed := ringmaster("status", env={"RINGMASTER_DATA_DIR": str(data_dir)})).returncode != 0:
        assert serve.poll() is None, f"serve exited with {serve.returncode}:\n{_log(data_dir)[-3000:]}"
        assert time.monotonic() < deadline, listed.stdout + listed.stderr
        time.sleep(0.5)
    return listed.stdout


def _tree_with_pool_workers(serve: subprocess.Popen[str], data_dir: Path) -> dict[int, int]:
    """The server's process tree once the warm pool's workers (Ray workers, each in a process group of its own) run."""
    deadline = time.monotonic() + 180
    while True:
        tree = _tree(serve.pid)
        if any(_command(pid).startswith("ray::TrainWorker") for pid in tree):
            break
        assert serve.poll() is None, f"serve exited with {serve.returncode}:\n{_log(data_dir)[-3000:]}"
        assert time.monotonic() < deadline, f"no warm pool worker started: {_described(set(tree))}"
        time.sleep(0.5)
    groups = {os.getpgid(pid) for pid in _alive(tree)}
    assert len(groups) > 2, "the tree spans the server's group, the head's and each worker's"
    return tree


# SIGTERM's stop is the adopting server's below (a server start each costs a minute of CI): the same checks.
@pytest.mark.parametrize("how", ["SIGINT", "ringmaster stop"])
def test_serve_says_where_it_listens_and_stops_with_every_process_it_started(tmp_path: Path, how: str) -> None:
    data_dir = tmp_path / "data"
    serve = _serve(data_dir)
    tree: dict[int, int] = {}
    try:
        assert "name" in _wait_serving(serve, data_dir), "the CLI found the server through the data directory alone"
        assert (data_dir / "api-url").read_text().startswith("http://127.0.0.1:")
        tree = _tree_with_pool_workers(serve, data_dir)
        assert not any("ray.util.client.server" in _command(pid) for pid in tree), "a Ray client server runs"
        ray_processes = _ray_processes(data_dir)
        assert ray_processes and ray_processes <= set(tree), "every Ray process of the server is in its tree"

        if how == "ringmaster stop":  # one server a data directory: a second is refused, naming the first
            second = ringmaster("serve", env={"RINGMASTER_DATA_DIR": str(data_dir)})
            assert one_line_failure(second) == (
                f"error: a ringmaster server already runs on {data_dir.resolve()} (pid {serve.pid}); `ringmaster stop` "
                "ends it, or set RINGMASTER_DATA_DIR to another directory for this one"
            )

        began = time.monotonic()
        if how == "ringmaster stop":
            stopped = ringmaster("stop", env={"RINGMASTER_DATA_DIR": str(data_dir)}, timeout_s=60)
            assert stopped.returncode == 0, stopped.stdout + stopped.stderr
            assert f"stopped the ringmaster server on {data_dir.resolve()} (pid {serve.pid})" in stopped.stdout
        else:
            serve.send_signal(signal.Signals[how])
        while serve.poll() is None and time.monotonic() < began + LEFT_AFTER_S:
            tree.update(_tree(serve.pid))  # anything it starts while it stops
            time.sleep(0.1)
        stop_s = time.monotonic() - began
        left = _alive_until(tree, began + LEFT_AFTER_S)
    finally:
        if serve.poll() is None:
            serve.kill()
        _kill(_alive(tree))
    print(f"{how}: serve exited after {stop_s:.1f} s, its tree of {len(tree)} processes gone")
    assert serve.returncode == 0, _log(data_dir)[-3000:]
    assert stop_s < STOP_GRACE_S + 2, f"serve took {stop_s:.1f} s to stop"
    assert not left, f"{LEFT_AFTER_S:.0f} s after {how}, still running: {_described(left)}"
    lines = [line for line in _log(data_dir).splitlines() if line.strip()]
    assert lines and all(json.loads(line)["level"] for line in lines), "not on a terminal: JSON lines"
    assert not (data_dir / "api-url").exists(), "a stopped server still says where it listened"
    assert not (data_dir / "ray-head.json").exists(), "a stopped server still records its head"
    if how == "ringmaster stop":
        again = ringmaster("stop", env={"RINGMASTER_DATA_DIR": str(data_dir)})
        assert (
            one_line_failure(again)
            == f"error: no ringmaster server is running on {data_dir.resolve()} (RINGMASTER_DATA_DIR)"
        )


def test_a_server_after_a_kill_9_adopts_the_ray_head_left_behind_and_runs_one(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    first = _serve(data_dir)
    second: subprocess.Popen[str] | None = None
    dead_tree: dict[int, int] = {}
    tree: dict[int, int] = {}
    try:
        _wait_serving(first, data_dir)
        dead_tree = _tree_with_pool_workers(first, data_dir)
        first.kill()
        first.wait(timeout=10)
        killed = time.monotonic()
        # Its Ray agent exits when its stdin closes, which the kernel does as its server dies.
        agents = {pid for pid in dead_tree if "warm_pool_agent" in _command(pid)}
        assert agents, _described(set(dead_tree))
        assert not _alive_until({pid: dead_tree[pid] for pid in agents}, killed + 30), "the agent lives on"
        print(f"the dead server's Ray agent exited {time.monotonic() - killed:.1f} s after it")
        orphaned = {pid for pid in _alive(dead_tree) if "gcs_server" in _command(pid)}
        assert len(orphaned) == 1, "kill -9 gives the server no chance to stop its head"

        second = _serve(data_dir)
        _wait_serving(second, data_dir)
        tree = _tree(second.pid)
        heads = {pid for pid in _alive(dead_tree) | _alive(tree) if "gcs_server" in _command(pid)}
        assert heads == orphaned, f"one Ray head, the adopted one: {_described(heads)}"

        began = time.monotonic()
        second.send_signal(signal.SIGTERM)
        while second.poll() is None and time.monotonic() < began + LEFT_AFTER_S:
            tree.update(_tree(second.pid))
            time.sleep(0.1)
        stop_s = time.monotonic() - began
        left = _alive_until(dead_tree | tree, began + LEFT_AFTER_S)
    finally:
        for serve in (first, second):
            if serve is not None and serve.poll() is None:
                serve.kill()
        _kill(_alive(dead_tree | tree))
    print(f"SIGTERM: the second serve exited after {stop_s:.1f} s, the adopted head's processes gone")
    assert second.returncode == 0, _log(data_dir)[-3000:]
    assert stop_s < STOP_GRACE_S + 2, f"serve took {stop_s:.1f} s to stop"
    assert not left, f"the adopted head outlived its new server: {_described(left)}"
    assert not (data_dir / "api-url").exists(), "a stopped server still says where it listened"
    assert not (data_dir / "ray-head.json").exists(), "a stopped server still records its head"


def test_a_recorded_head_that_runs_but_does_not_answer_is_ended_before_another_starts(tmp_path: Path) -> None:
    stuck = start_head(tmp_path)
    tree = {stuck.pid: stuck.started_at, **_tree(stuck.pid)}
    replacement = None
    try:
        dashboard = next(pid for pid in tree if "dashboard/dashboard.py" in _command(pid))
        os.kill(dashboard, signal.SIGSTOP)  # its pid alive, its dashboard silent
        replacement = start_head(tmp_path)
        assert replacement.pid != stuck.pid
        left = _alive_until(tree, time.monotonic() + 5)
        assert not left, f"two heads on one data directory: {_described(left)}"
        assert replacement.alive()
    finally:
        if replacement is not None:
            stop_head(replacement, tmp_path, grace_s=0)
        _kill(_alive(tree))


def test_a_head_that_cannot_start_is_tried_twice_then_named_in_one_line(tmp_path: Path) -> None:
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
    assert not _left_behind(tmp_path), "a failed start left processes behind"
