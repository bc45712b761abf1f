"""An embedded single-node Ray head for `ringmaster serve`/`demo` and the tests.

Started as `ray start --head --block` in its own process group, so stopping it ends exactly the
processes it started (never `ray stop`, which would end every Ray on the machine). Its ports are
chosen free, never 6379, and recorded in the data directory so a restarted server reuses it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

_STATE_FILE = "ray-head.json"

# Declare a node dead within seconds instead of Ray's default of about a minute, so its placement-group bundles are
# rescheduled quickly (ringmaster's own heartbeats notice first). Three failed checks: a node whose raylet is gone
# refuses each at once, so it is declared dead ~1.5 s after (3 periods); a live but unresponsive one must miss three
# 1 s timeouts in a row (~4 s), so a briefly busy raylet is not taken for a dead one.
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
# Ray starts worker processes at nice 15, below every other process on the node. Training workers are the node's
# main work: at 15 the dashboard, log monitors and job drivers preempt them (bare torchrun runs at 0). Pool workers
# warm up in a thread at 19, which only a node at 0 keeps from competing with training.
CLUSTER_SYSTEM_CONFIG = {**FAST_HEALTH_CHECKS, "worker_niceness": 0}


@dataclass(frozen=True)
class RayHead:
    pid: int
    gcs_address: str
    dashboard_url: str

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except OSError:
            return False
        return _dashboard_ready(self.dashboard_url)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dashboard_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/api/version", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _ray_executable() -> str:
    beside_python = Path(sys.executable).with_name("ray")
    return str(beside_python) if beside_python.exists() else (shutil.which("ray") or "ray")


def start_head(data_dir: Path, *, num_cpus: int | None = None, resources: dict[str, float] | None = None,
               system_config: dict | None = None, timeout_s: float = 60.0) -> RayHead:
    """Start a local head (or reuse the one recorded in data_dir if it still answers)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    state_path = data_dir / _STATE_FILE
    if state_path.exists():
        recorded = RayHead(**json.loads(state_path.read_text()))
        if recorded.alive():
            return recorded
        state_path.unlink()

    port, dashboard_port = _free_port(), _free_port()
    # Its own temp dir: Ray resolves "auto" addresses (as the Jobs API does for each job's driver)
    # through <temp dir>/ray_current_cluster, which a shared /tmp/ray lets another cluster overwrite.
    # Kept short: Ray's Unix socket paths live below it.
    temp_dir = tempfile.mkdtemp(prefix="rm-", dir="/tmp")
    command = [
        _ray_executable(), "start", "--head", "--block",
        "--port", str(port),
        "--dashboard-host", "127.0.0.1",
        "--dashboard-port", str(dashboard_port),
        "--include-dashboard", "true",
        "--ray-client-server-port", str(_free_port()),
        "--dashboard-agent-listen-port", str(_free_port()),
        "--disable-usage-stats",
        "--temp-dir", temp_dir,
    ]
    if num_cpus is not None:
        command += ["--num-cpus", str(num_cpus)]
    if resources:
        command += ["--resources", json.dumps(resources)]
    command += ["--system-config", json.dumps({**CLUSTER_SYSTEM_CONFIG, **(system_config or {})})]
    log = open(data_dir / "ray-head.log", "ab")
    # The head's processes inherit PATH, so the job driver finds this interpreter's packages.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    head = RayHead(pid=process.pid, gcs_address=f"127.0.0.1:{port}", dashboard_url=f"http://127.0.0.1:{dashboard_port}")
    deadline = time.monotonic() + timeout_s
    while not _dashboard_ready(head.dashboard_url):
        if process.poll() is not None:
            raise RuntimeError(f"ray head exited with code {process.returncode}; see {data_dir / 'ray-head.log'}")
        if time.monotonic() > deadline:
            stop_head(head)
            raise TimeoutError(f"ray head did not answer within {timeout_s:.0f}s; see {data_dir / 'ray-head.log'}")
        time.sleep(0.25)
    state_path.write_text(json.dumps(asdict(head)))
    return head


def stop_head(head: RayHead, data_dir: Path | None = None, grace_s: float = 10.0) -> None:
    """End the head's process group: SIGTERM first (it stops its children), SIGKILL what is left."""
    try:
        os.killpg(head.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.kill(head.pid, 0)
        except OSError:
            break
        _reap(head.pid)
        time.sleep(0.1)
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _reap(head.pid)
    if data_dir is not None:
        (data_dir / _STATE_FILE).unlink(missing_ok=True)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
