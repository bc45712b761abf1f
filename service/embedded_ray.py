"""An embedded single-node Ray head for `ringmaster serve`/`demo` and the tests.

Started as `ray start --head --block` (through this module, which leaves out Ray's client server unless asked for)
in a session of its own, so stopping it ends exactly the processes it started (never `ray stop`, which would end
every Ray on the machine). Its ports are chosen free, never 6379, and recorded in the data directory: a server started
after one that died without stopping it (kill -9) adopts the head if it answers, and ends it otherwise, so a data
directory never has two. A start that fails is cleaned up and tried once more before the cause is reported.

Safe by default: every process of the head listens on loopback alone (node_ip_address 127.0.0.1), and the cluster runs
with Ray's token authentication, its token a file in the data directory (service/ray_auth.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from ringmaster.service.process_tree import ProcessTree, process_started_at
from ringmaster.service.ray_auth import TOKEN_FILE, RayAuth, ensure_token_file

log = logging.getLogger(__name__)

_STATE_FILE = "ray-head.json"
# Set in the head's environment (every Ray process inherits it) to the data directory it belongs to: a head whose
# server died before it recorded the head is still found, and ended, by the next server on that directory.
_HEAD_OF = "RINGMASTER_EMBEDDED_HEAD_OF"

# Declare a node dead within a second instead of Ray's default of about a minute, so its placement-group bundles are
# rescheduled at once (a replacement on spare capacity waits for that; ringmaster's own heartbeats notice first).
# Three failed checks: a node whose raylet is gone refuses each at once, so it is declared dead ~0.6 s after (3
# periods); a live but unresponsive one must miss three 1 s timeouts in a row (~3.6 s), so a briefly busy raylet is
# not taken for a dead one. A check every 200 ms is 5 small RPCs per node per second to the GCS.
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 200,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
# Ray starts worker processes at nice 15, below every other process on the node. Training workers are the node's
# main work: at 15 the dashboard, log monitors and job drivers preempt them (bare torchrun runs at 0). Pool workers
# warm up in a thread at 19, which only a node at 0 keeps from competing with training.
CLUSTER_SYSTEM_CONFIG = {**FAST_HEALTH_CHECKS, "worker_niceness": 0}

LOOPBACK = "127.0.0.1"
# Ray binds its gRPC servers (GCS, raylet, every worker, the dashboard agent) to loopback only when the node's address
# is 127.0.0.1, and otherwise to every interface. But on Linux it rewrites a loopback address to the machine's own
# (services.resolve_ip_for_localhost), in `ray start` and in each ray.init, unless it takes the machine for a
# single-node one: this variable, in the head's environment, is inherited by every process of the cluster (drivers,
# workers), and a client of the head needs it too (ray_cluster.ray_client_env).
SINGLE_NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@dataclass(frozen=True)
class RayHead:
    pid: int
    gcs_address: str
    dashboard_url: str
    metrics_url: str | None = None  # the node's Prometheus endpoint: Ray's own series and the jobs' training series
    auth_token_path: str | None = None  # the file that holds the cluster's token (None: a head without authentication)
    started_at: int | None = None  # its process's start time: a later process given the same pid is not the head

    @property
    def auth(self) -> RayAuth | None:
        return None if self.auth_token_path is None else RayAuth(token_path=Path(self.auth_token_path))

    def running(self) -> bool:
        """Its process still runs (whether or not the head answers)."""
        started = process_started_at(self.pid)
        if started is None:
            return False
        if self.started_at is not None:
            return started == self.started_at
        try:  # recorded before start times were: the pid's command line must still be a head's
            return b"ringmaster.service.embedded_ray" in Path(f"/proc/{self.pid}/cmdline").read_bytes()
        except OSError:
            return False

    def alive(self) -> bool:
        return self.running() and _dashboard_ready(self.dashboard_url, self.auth)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]  # an IPv4 socket's name is (host, port)
        return port


def _dashboard_ready(url: str, auth: RayAuth | None) -> bool:
    try:
        headers = auth.headers() if auth else None
        return httpx.get(f"{url}/api/version", headers=headers, timeout=1.0).status_code == 200
    except (httpx.HTTPError, OSError):  # OSError: the token file is gone
        return False


class HeadStartFailed(RuntimeError):
    """The embedded head did not come up (twice); the message holds the cause from its log, and the log's path."""


# Lines of a failed head's log that say why, most telling first.
_CAUSE_MARKERS = ("Error", "error", "Failed", "failed", "Exception", "Timed out", "timed out")


def _cause(log_path: Path, offset: int) -> str:
    """The last lines of this start's part of the head's log that name an error, else its last line."""
    try:
        with open(log_path, "rb") as log:
            log.seek(offset)
            lines = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log was written"
    telling = [line for line in lines if any(marker in line for marker in _CAUSE_MARKERS)]
    return " | ".join(telling[-2:]) if telling else (lines[-1] if lines else "the log is empty")


def start_head(
    data_dir: Path,
    *,
    num_cpus: int | None = None,
    resources: dict[str, float] | None = None,
    system_config: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
    ray_client_server: bool = False,
    attempts: int = 2,
    port: int | None = None,
    dashboard_port: int | None = None,
    env: dict[str, str] | None = None,
    node_ip_address: str | None = LOOPBACK,
    auth_token_file: Path | None = None,
) -> RayHead:
    """Start a local head (or reuse the one recorded in data_dir if it still answers). A start that fails (the
    process exits, or the dashboard does not answer in timeout_s) is cleaned up, every process of it ended, and tried
    again up to `attempts` times in all; then HeadStartFailed says why and where the log is. `port` (the GCS's) and
    `dashboard_port`: free ones unless given (a new cluster at an old one's address). `env`: more variables for the
    head's processes (e.g. RAY_REDIS_ADDRESS, for GCS fault tolerance). `node_ip_address`: what the head advertises and
    listens on (LOOPBACK: loopback alone; another address, or None for the machine's own as Ray picks it: every
    interface, for worker nodes to join). `auth_token_file`: the cluster's token, created if missing; by default
    data_dir/ray-auth-token.

    A recorded head that runs but does not answer, and any head of data_dir that no record names (its server died
    while starting it), is ended first: data_dir never has two heads."""
    data_dir.mkdir(parents=True, exist_ok=True)
    state_path = data_dir / _STATE_FILE
    recorded = recorded_head(data_dir)
    for pid in _unrecorded_heads(data_dir, recorded):
        log.warning("ending a Ray head (pid %d) left unrecorded by a server that died while starting it", pid)
        ProcessTree(pid).end(grace_s=HEAD_STOP_GRACE_S)
    if recorded is not None:
        if recorded.running() and _answers_within(recorded, min(timeout_s, _ADOPT_WAIT_S)):
            log.info("adopting the running Ray head (pid %d) recorded in %s", recorded.pid, data_dir)
            return recorded
        if recorded.running():
            log.warning(
                "ending the Ray head (pid %d) recorded in %s: it runs but does not answer", recorded.pid, data_dir
            )
        stop_head(recorded, data_dir)
    env = {**(env or {}), _HEAD_OF: str(data_dir.resolve())}
    log_path = data_dir / "ray-head.log"
    causes = []
    for _ in range(attempts):
        offset = log_path.stat().st_size if log_path.exists() else 0
        try:
            head = _start_once(
                data_dir,
                log_path,
                num_cpus,
                resources,
                system_config,
                timeout_s,
                ray_client_server,
                port,
                dashboard_port,
                env,
                node_ip_address,
                auth_token_file or data_dir / TOKEN_FILE,
            )
        except _StartFailed as failure:
            causes.append(f"{failure}: {_cause(log_path, offset)}")
            continue
        head = replace(head, started_at=process_started_at(head.pid))
        partial = state_path.with_name(f".{state_path.name}.{os.getpid()}")
        partial.write_text(json.dumps(asdict(head)))
        os.replace(partial, state_path)  # whole or not at all: a server killed while writing leaves no torn record
        return head
    raise HeadStartFailed(
        f"the embedded Ray head did not start ({len(causes)} tries). Last: {causes[-1]}. Its log: {log_path.resolve()}"
    )


class _StartFailed(RuntimeError):
    pass


# How long a stopping head's processes get between SIGTERM and SIGKILL. Ray's own stop of a head does not finish within
# a container's grace period: `ray start` ends its processes one kind at a time, and the GCS was seen to wait over 10 s
# on a metrics export to the dashboard agent that had stopped already. What stops at all (dashboard, agents, workers)
# does so in the first seconds; the rest is killed then.
HEAD_STOP_GRACE_S = 3.0
# A head is recorded once its dashboard has answered: a recorded head that runs but does not answer within this is
# stuck, not starting, and is ended rather than adopted.
_ADOPT_WAIT_S = 10.0


def recorded_head(data_dir: Path) -> RayHead | None:
    """The head data_dir's record names, running or not."""
    try:
        return RayHead(**json.loads((data_dir / _STATE_FILE).read_text()))
    except (OSError, ValueError, TypeError):  # none, or a record this version cannot read
        return None


def _answers_within(head: RayHead, timeout_s: float) -> bool:
    """The head's dashboard answers within timeout_s (a busy one may be slow to) while its process runs."""
    deadline = time.monotonic() + timeout_s
    while not _dashboard_ready(head.dashboard_url, head.auth):
        if time.monotonic() > deadline or not head.running():
            return False
        time.sleep(0.25)
    return True


def _unrecorded_heads(data_dir: Path, recorded: RayHead | None) -> list[int]:
    """The heads of data_dir running now (session leaders whose environment names it as theirs) but the recorded
    one."""
    mark = f"{_HEAD_OF}={data_dir.resolve()}".encode()
    known = recorded.pid if recorded is not None and recorded.running() else None
    heads = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == known:
            continue
        try:
            if (
                os.getsid(int(entry)) == int(entry)
                and b"ringmaster.service.embedded_ray" in Path(f"/proc/{entry}/cmdline").read_bytes()
                and mark in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            ):
                heads.append(int(entry))
        except OSError:  # gone, or another user's
            continue
    return heads


# What the server's environment may hold that the cluster's processes must not inherit: every job's driver and workers,
# and so every tenant's code, run below the head. The control plane's own secrets (the CLI's API token, a database URL
# with its password), and a Ray token in RAY_AUTH_TOKEN, which would take precedence over the head's own.
_NOT_FOR_THE_CLUSTER = frozenset(
    {"RINGMASTER_TOKEN", "RINGMASTER_DATABASE_URL", "RINGMASTER_RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN"}
)


def _start_once(
    data_dir: Path,
    log_path: Path,
    num_cpus: int | None,
    resources: dict[str, float] | None,
    system_config: dict[str, Any] | None,
    timeout_s: float,
    ray_client_server: bool,
    port: int | None,
    dashboard_port: int | None,
    extra_env: dict[str, str],
    node_ip_address: str | None,
    auth_token_file: Path,
) -> RayHead:
    port, dashboard_port, metrics_port = port or _free_port(), dashboard_port or _free_port(), _free_port()
    auth = RayAuth(token_path=ensure_token_file(auth_token_file).resolve())
    # Its own temp dir: Ray resolves "auto" addresses (as the Jobs API does for each job's driver)
    # through <temp dir>/ray_current_cluster, which a shared /tmp/ray lets another cluster overwrite.
    # Kept short: Ray's Unix socket paths live below it.
    temp_dir = tempfile.mkdtemp(prefix="rm-", dir="/tmp")
    command = [
        sys.executable,
        "-m",
        "ringmaster.service.embedded_ray",
        *([] if ray_client_server else ["--no-client-server"]),
        "start",
        "--head",
        "--block",
        *(["--node-ip-address", node_ip_address] if node_ip_address else []),
        "--port",
        str(port),
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(dashboard_port),
        "--include-dashboard",
        "true",
        *(["--ray-client-server-port", str(_free_port())] if ray_client_server else []),
        # 0: the agent binds a port the kernel hands it and publishes that one. A port found free here can be taken
        # before the agent binds it, seconds later on a loaded machine, which leaves the head without the agent
        # every Jobs API submission goes through ("No available agent to submit job", seen in CI).
        "--dashboard-agent-listen-port",
        "0",
        "--metrics-export-port",
        str(metrics_port),
        "--disable-usage-stats",
        "--temp-dir",
        temp_dir,
    ]
    if num_cpus is not None:
        command += ["--num-cpus", str(num_cpus)]
    if resources:
        command += ["--resources", json.dumps(resources)]
    command += ["--system-config", json.dumps({**CLUSTER_SYSTEM_CONFIG, **(system_config or {})})]
    # The head's processes inherit PATH, so the job driver finds this interpreter's packages; and the token's path,
    # so the job drivers and workers present it too (a token inherited in RAY_AUTH_TOKEN would take precedence).
    env = {key: value for key, value in os.environ.items() if key not in _NOT_FOR_THE_CLUSTER}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **auth.client_env())
    if node_ip_address == LOOPBACK:
        env.update(SINGLE_NODE_ENV)
        # The jobs' process groups too: gloo's pairs and NCCL's bootstrap listen on the interface these name (by
        # default the one the host name resolves to, or the first that is not loopback), unless a person chose one.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    # The dashboard's and the autoscaler monitor's own metrics endpoints listen on fixed ports (44227, 44217) unless
    # these name others: a second head on the machine (another data directory's server) found them taken, and its
    # dashboard never came up ("Module MetricsHead failed to start").
    env.setdefault("DASHBOARD_METRIC_PORT", str(_free_port()))
    env.setdefault("AUTOSCALER_METRIC_PORT", str(_free_port()))
    env.update(extra_env)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    head = RayHead(
        pid=process.pid,
        gcs_address=f"{node_ip_address or LOOPBACK}:{port}",
        dashboard_url=f"http://127.0.0.1:{dashboard_port}",
        metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
        auth_token_path=str(auth.token_path),
    )
    deadline = time.monotonic() + timeout_s
    while not _dashboard_ready(head.dashboard_url, auth):
        failure = None
        if process.poll() is not None:
            failure = f"`ray start` exited with code {process.returncode}"
        elif time.monotonic() > deadline:
            failure = f"its dashboard did not answer within {timeout_s:.0f}s"
        if failure is not None:
            stop_head(head)  # the processes it did start sit in its process group: none is left behind
            raise _StartFailed(failure)
        time.sleep(0.25)
    return head


def _descendants(pid: int) -> dict[int, int]:
    """pid -> start time of every live process below pid (harness/fault_tolerant_cluster.py ends its nodes' trees)."""
    return ProcessTree(pid, include_root=False).members


def stop_head(head: RayHead, data_dir: Path | None = None, grace_s: float = HEAD_STOP_GRACE_S) -> None:
    """End every process of the head: SIGTERM to its process group first (Ray's own stop: `ray start` ends the GCS,
    the dashboard and the raylet, the raylet its workers), then, after grace_s, whatever of its tree is left, those
    started meanwhile and those Ray put in groups and sessions of their own included (service/process_tree.py)."""
    if head.running():
        tree = ProcessTree(head.pid)
        tree.end(grace_s, terminate=lambda: _signal_group(head.pid, signal.SIGTERM))
    elif process_started_at(head.pid) is None:
        # Its own process is gone, and no other took its pid: whatever still runs in its session is the head's.
        ProcessTree(None, sessions=[head.pid]).end(grace_s)
    # Otherwise its pid is another process's now, which the kernel allows only once nothing of its session is left.
    if data_dir is not None:
        (data_dir / _STATE_FILE).unlink(missing_ok=True)


def _signal_group(group: int, signum: int) -> None:
    try:
        os.killpg(group, signum)
    except ProcessLookupError:
        pass


def _ray_start(argv: list[str]) -> None:
    """`ray start ARGV`, as the `ray` command runs it; after --no-client-server, without the Ray client server
    (ray://), which ringmaster does not use and `ray start` offers no way to leave out (a slow one once failed whole
    starts on a loaded machine): it starts one whenever its client's dependency (grpc) imports."""
    from ray.scripts import scripts

    if argv[:1] == ["--no-client-server"]:
        argv = argv[1:]
        # Replaced where `ray start` looks it up: the name scripts imported (no re-export mypy would accept).
        scripts.get_ray_client_dependency_error = lambda: ImportError(  # type: ignore[attr-defined]
            "no Ray client server on ringmaster's head"
        )
    sys.argv = ["ray", *argv]
    scripts.main()  # type: ignore[no-untyped-call]  # Ray leaves its click entry point unannotated


if __name__ == "__main__":
    _ray_start(sys.argv[1:])
