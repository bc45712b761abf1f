"""`ringmaster serve` on embedded defaults is safe as it comes: nothing of its process tree (server, Ray head, Ray
agent, driver, workers, their process group) listens beyond loopback, and its Ray cluster refuses whoever lacks the
token, while ringmaster's own path runs a job to the end. One real server for the module, stopped with everything it
started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from harness.listening_sockets import ListeningSocket, listening_sockets
from harness.ports import free_port
from ringmaster.service.client import RingmasterClient
from ringmaster.service.embedded_ray import SINGLE_NODE_ENV, RayHead, stop_head
from ringmaster.service.process_tree import ProcessTree
from ringmaster.service.ray_auth import TOKEN_FILE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

REPO_ROOT = Path(__file__).resolve().parents[2]
# Two DDP ranks on gloo (a rendezvous store, gloo's pairs), paced so the job is still running when its sockets are read.
SPEC = {
    "name": "safe-defaults",
    "model": "tests.support.paced_model:build",
    "model_options": {"pause_s": 0.1, "n_val": 16},
    "strategy": "ddp",
    "workers": {"min": 2, "max": 2, "cpus_per_worker": 1},
    "train": {"steps": 80, "global_batch_size": 8, "micro_batch_size": 4, "lr": 0.01},
    "checkpoint": {"every_steps": 0},
}


@dataclass
class Served:
    process: subprocess.Popen[str]
    data_dir: Path
    client: RingmasterClient
    job_id: str
    sockets_while_running: list[ListeningSocket]
    head_processes: int  # of the Ray head's tree while the job ran (its workers and the job's ranks among them)
    holding_the_server_secret: list[str]  # the commands of those whose environment held the server's API token

    @property
    def head(self) -> RayHead:
        return RayHead(**json.loads((self.data_dir / "ray-head.json").read_text()))


def _clean_env() -> dict[str, str]:
    """This environment without ringmaster's or Ray's own settings: defaults, as a new user has them."""
    return {key: value for key, value in os.environ.items() if not key.startswith(("RINGMASTER_", "RAY_"))}


# In the server's environment, as an operator's API token may be: never in the cluster's, where tenants' code runs.
SERVER_SECRET = "server-secret-" + os.urandom(8).hex()


def _holding(secret: str, pids: set[int]) -> list[str]:
    """The commands of the processes among pids whose environment holds secret."""
    found = []
    for pid in pids:
        try:
            if secret.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue  # ended meanwhile
    return found


def _wait(condition: object, what: str, timeout_s: float, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not callable(condition) or not condition():
        assert process.poll() is None, f"`ringmaster serve` exited with {process.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`ringmaster serve` on embedded defaults with one job, read while it runs; the server is stopped afterwards and
    any process of its tree still alive then is killed."""
    data_dir = tmp_path_factory.mktemp("safe-defaults")
    env = {
        **_clean_env(),
        "RINGMASTER_DATA_DIR": str(data_dir),
        "RINGMASTER_API_PORT": str(free_port()),
        "RINGMASTER_TOKEN": SERVER_SECRET,  # read by the CLI only: the server serves the same with it
    }
    with open(data_dir / "serve.log", "w") as log:  # the child writes through its own copy of the descriptor
        process = subprocess.Popen(
            [sys.executable, "-m", "ringmaster.cli", "serve"],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
            text=True,
        )
    tree = ProcessTree(process.pid)  # each member with its start time: a pid reused meanwhile is never signalled
    head: RayHead | None = None
    try:
        _wait(lambda: (data_dir / "api-url").exists() and (data_dir / "admin.token").exists(), "api-url", 120, process)
        client = RingmasterClient((data_dir / "api-url").read_text().strip(), token=_admin_token(data_dir))
        head = RayHead(**json.loads((data_dir / "ray-head.json").read_text()))
        job_id = client.submit(SPEC)["id"]
        _wait(
            lambda: client.job(job_id)["state"] == "RUNNING" and client.metrics(job_id)["items"],
            "metrics",
            180,
            process,
        )
        sockets = listening_sockets(process.pid)
        head_tree = ProcessTree(head.pid).look()
        yield Served(process, data_dir, client, job_id, sockets, len(head_tree), _holding(SERVER_SECRET, head_tree))
    finally:
        tree.look()
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        if head is not None:
            stop_head(head, grace_s=2.0)  # a no-op after a clean stop
        tree.end(grace_s=0)  # likewise


def _admin_token(data_dir: Path) -> str:
    return (data_dir / "admin.token").read_text().strip()


def test_every_socket_of_the_server_tree_listens_on_loopback_while_a_job_runs(served: Served) -> None:
    sockets = served.sockets_while_running
    commands = " ".join(s.command for s in sockets)
    # What was read is the whole tree: the API, Ray's GCS and raylet, and the job's training ranks.
    assert "gcs_server" in commands and "raylet" in commands, commands
    assert any(s.pid == served.process.pid for s in sockets), "the API server's own socket is missing"
    assert any("TrainWorker" in s.command or "ray::" in s.command for s in sockets), commands
    beyond = [s for s in sockets if not s.loopback_only]
    assert not beyond, "listening beyond loopback:\n" + "\n".join(
        f"{s.host}:{s.port} {s.command[:120]}" for s in beyond
    )


def test_no_process_of_the_cluster_inherits_the_servers_secrets(served: Served) -> None:
    """The head's tree holds every process a tenant's code runs in; the server's environment (its API token here, a
    database URL with its password in production) stays with the server."""
    assert served.head_processes > 5, "the head's tree was not read while the job ran"
    assert _holding(SERVER_SECRET, {served.process.pid}), "the marker is not in the server's own environment"
    assert not served.holding_the_server_secret, served.holding_the_server_secret


def test_ringmasters_own_path_runs_the_job_to_the_end(served: Served) -> None:
    deadline = time.monotonic() + 180
    while (job := served.client.job(served.job_id))["state"] not in {"SUCCEEDED", "FAILED", "CANCELLED"}:
        assert time.monotonic() < deadline, f"the job is still {job['state']}"
        time.sleep(0.5)
    assert job["state"] == "SUCCEEDED", job["error"]


def test_the_jobs_api_refuses_a_request_without_the_token(served: Served) -> None:
    head = served.head
    token_file = served.data_dir / TOKEN_FILE
    assert head.auth_token_path == str(token_file.resolve())
    assert token_file.stat().st_mode & 0o777 == 0o600, "the token file is readable by others"
    assert httpx.get(f"{head.dashboard_url}/api/jobs/", timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer " + "0" * 64}
    assert httpx.get(f"{head.dashboard_url}/api/jobs/", headers=wrong, timeout=10).status_code == 403
    assert head.auth is not None
    assert httpx.get(f"{head.dashboard_url}/api/jobs/", headers=head.auth.headers(), timeout=10).status_code == 200


def test_ray_init_without_the_token_is_refused(served: Served) -> None:
    """In a process of its own with none of Ray's variables but the one that keeps the loopback address as given, so
    that only the token is missing; the same process with the head's token variables joins."""
    head = served.head
    join = f"import ray; ray.init(address={head.gcs_address!r}, log_to_driver=False); print('joined')"
    # Two tries to connect, not Ray's twenty (a second apart): the answer is the same.
    refused_fast = {**SINGLE_NODE_ENV, "RAY_gcs_server_port_wait_time_s": "2"}
    without = subprocess.run(
        [sys.executable, "-c", join], env={**_clean_env(), **refused_fast}, capture_output=True, text=True, timeout=120
    )
    assert without.returncode != 0 and "joined" not in without.stdout
    assert "token" in without.stderr.lower(), without.stderr[-2000:]
    assert head.auth is not None
    with_token = subprocess.run(
        [sys.executable, "-c", join],
        env={**_clean_env(), **SINGLE_NODE_ENV, **head.auth.client_env()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert with_token.returncode == 0 and "joined" in with_token.stdout, with_token.stderr[-2000:]
