"""The node's fork server (workers/rank_forkserver.py) without Ray: a stand-in process plays the raylet. A training
process it forks serves its actor's calls in its actor's directory, and ends with its actor; the server ends with its
raylet, and takes its training processes with it."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from ringmaster.workers import rank_forkserver

ENDS_WITHIN_S = 15.0


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _ends(pid: int) -> bool:
    deadline = time.monotonic() + ENDS_WITHIN_S
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _running(pid)


@pytest.fixture
def raylet() -> Iterator[subprocess.Popen[bytes]]:
    stand_in = subprocess.Popen(["sleep", "600"])
    yield stand_in
    stand_in.kill()
    stand_in.wait()


def _forked(path: Path, raylet_pid: int) -> tuple[rank_forkserver.ForkedRankProcess, Connection]:
    ours, theirs = socket.socketpair()
    process = rank_forkserver.request_fork(path, raylet_pid, theirs.fileno())
    theirs.close()
    assert process is not None, "the server forked no training process"
    return process, Connection(ours.detach())


def _call(connection: Connection, method: str, *args: object) -> object:
    connection.send((0, method, args))
    call_id, succeeded, payload, text, _ = connection.recv()
    assert call_id == 0 and succeeded, text
    return pickle.loads(payload)


def test_a_forked_process_serves_its_actor_where_the_actor_runs_and_reports_how_it_ended(
    tmp_path: Path, raylet: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    process, connection = _forked(tmp_path / "server.sock", raylet.pid)
    assert _call(connection, "whereabouts") == f"no group yet, pid {process.pid}"
    assert _call(connection, "resume_step", str(tmp_path / "no-checkpoints"), None) == 0
    assert Path(f"/proc/{process.pid}/cwd").resolve() == tmp_path.resolve()
    server = _parent(process.pid)
    assert "ringmaster.workers.rank_forkserver" in Path(f"/proc/{server}/cmdline").read_text()

    # A second actor's process comes from the same server, already warm.
    second, second_connection = _forked(tmp_path / "server.sock", raylet.pid)
    assert _parent(second.pid) == server and second.pid != process.pid
    _call(second_connection, "warm_up")

    os.kill(process.pid, signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    connection.close()
    second_connection.close()
    assert second.wait() == 0, "a process whose actor's connection ends exits by itself"


def test_the_process_ends_when_its_actor_s_request_closes_and_the_server_with_its_raylet(
    tmp_path: Path, raylet: subprocess.Popen[bytes]
) -> None:
    process, connection = _forked(tmp_path / "server.sock", raylet.pid)
    _call(connection, "warm_up")
    server = _parent(process.pid)
    process._channel.close()  # as when the actor's process dies: the kernel closes its request to the server
    assert _ends(process.pid), "the server did not kill a process whose actor is gone"

    survivor, survivor_connection = _forked(tmp_path / "server.sock", raylet.pid)
    assert _parent(survivor.pid) == server
    raylet.kill()
    raylet.wait()
    assert _ends(server) and _ends(survivor.pid), "the server and its processes outlived their raylet"
    assert not (tmp_path / "server.sock").exists() and not (tmp_path / "server.lock").exists()
    survivor_connection.close()
    assert survivor.wait() is None, "no exit code from a server that ended"


def test_a_job_whose_import_path_shadows_a_module_the_server_imported_gets_no_fork(
    tmp_path: Path, raylet: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job with its own numpy (a pip runtime env, say) would run the server's copy in a forked process: refused,
    its actor starts the process afresh; a job with only modules of its own is forked."""
    own = tmp_path / "job-code"
    (own / "numpy").mkdir(parents=True)
    (own / "my_model.py").write_text("")
    monkeypatch.syspath_prepend(str(own))
    ours, theirs = socket.socketpair()
    assert rank_forkserver.request_fork(tmp_path / "server.sock", raylet.pid, theirs.fileno()) is None
    theirs.close()
    ours.close()
    (own / "numpy").rmdir()
    process, connection = _forked(tmp_path / "server.sock", raylet.pid)
    assert _call(connection, "whereabouts") == f"no group yet, pid {process.pid}"
    connection.close()
    assert process.wait() == 0


def test_shadowed_modules_are_other_copies_of_imported_modules_in_the_path_entries_the_server_lacks(
    tmp_path: Path,
) -> None:
    job = tmp_path / "job"
    (job / "torch").mkdir(parents=True)
    (job / "yaml.py").write_text("")
    (job / "_cext.cpython-311-x86_64-linux-gnu.so").write_text("")
    (job / "mine.py").write_text("")
    shared = tmp_path / "shared"
    (shared / "json").mkdir(parents=True)  # the very copy the server imported, seen through another entry
    zipped = tmp_path / "modules.zip"
    zipped.write_bytes(b"")
    imported = {
        "torch": {"/site/torch"},
        "yaml": {"/site/yaml.py"},
        "_cext": {"/site/_cext.so"},
        "json": {os.path.realpath(shared / "json")},
    }
    assert rank_forkserver.shadowed_modules([str(job), str(shared), "/usr/lib"], ["/usr/lib"], imported) == {
        "torch",
        "yaml",
        "_cext",
    }
    assert rank_forkserver.shadowed_modules([str(job)], [str(job)], imported) == set(), "the server's own entry"
    assert rank_forkserver.shadowed_modules([str(tmp_path / "gone")], [], imported) == set()
    assert rank_forkserver.shadowed_modules([str(zipped)], [], imported) == set(imported), "a zip may hold any"
    ray_vendored = (str(tmp_path) + os.sep,)
    assert rank_forkserver.shadowed_modules([str(job)], [], imported, ray_vendored) == set(), "Ray's own copies"
