"""A `ray start` cluster with GCS fault tolerance, on one machine: Debian's redis-server holds the GCS's state, the
head runs only the GCS, dashboard and Jobs API (no CPUs), and worker nodes are `ray start --address` processes
that alone have the `ringmaster_driver` resource, so drivers (Settings.driver_resources) run off the head.

`restart_head()` kills every process of the head, as a lost head pod, and starts a new head at the same GCS and
dashboard ports on the same Redis: the worker nodes, their actors and the drivers on them live through it.

Every head of it runs with one token (as a KubeRay cluster's pods take theirs from one Secret), which the worker
nodes present too. Its heads listen on the machine's address, not loopback alone: a `ray start --address` worker node
joins only a head that does (Ray takes a loopback address for the machine's own, where such a head does not listen).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from harness.ports import free_port
from ringmaster.service.embedded_ray import RayHead, start_head, stop_head
from ringmaster.service.ray_auth import TOKEN_FILE

DRIVER_RESOURCE = "ringmaster_driver"


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


def _kill_tree(process: subprocess.Popen) -> None:
    """A `ray start` node or redis-server in a session of its own: its group, then anything of its tree left."""
    from ringmaster.service.embedded_ray import _descendants  # the head's own teardown walks the tree the same way

    tree = _descendants(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=10)


class FaultTolerantCluster:
    def __init__(self, data_dir: Path, worker_nodes: int = 1, cpus_per_node: int = 3) -> None:
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self.cpus_per_node = cpus_per_node
        self.redis_port = free_port()
        with open(data_dir / "redis.log", "ab") as log:  # the child writes through its own copy of the descriptor
            self.redis = subprocess.Popen(
                [
                    redis_server_path() or "redis-server",
                    "--port",
                    str(self.redis_port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.head_env = {
            "RAY_REDIS_ADDRESS": f"127.0.0.1:{self.redis_port}",
            # One cluster's keys in Redis: a restarted head finds them under the same namespace.
            "RAY_external_storage_namespace": f"ringmaster-test-{uuid.uuid4().hex[:8]}",
        }
        self.heads = 0
        self.head = self._start_head()
        self.nodes: list[subprocess.Popen] = []
        try:
            for _ in range(worker_nodes):
                self.add_node()
            self.wait_for_resources(CPU=worker_nodes * cpus_per_node, **{DRIVER_RESOURCE: worker_nodes})
        except BaseException:
            self.shutdown()
            raise

    def _start_head(self, port: int | None = None, dashboard_port: int | None = None) -> RayHead:
        self.heads += 1
        return start_head(
            self.data_dir / f"head-{self.heads}",
            num_cpus=0,
            env=self.head_env,
            port=port,
            dashboard_port=dashboard_port,
            node_ip_address=None,
            auth_token_file=self.data_dir / TOKEN_FILE,
        )

    def add_node(self) -> None:
        command = [
            sys.executable,
            "-m",
            "ringmaster.service.embedded_ray",
            "--no-client-server",
            "start",
            "--block",
            "--address",
            self.head.gcs_address,
            "--num-cpus",
            str(self.cpus_per_node),
            "--resources",
            json.dumps({DRIVER_RESOURCE: 1}),
            "--disable-usage-stats",
            "--dashboard-agent-listen-port",
            "0",  # not Ray's fixed default, which another node on this machine may hold
            "--temp-dir",
            tempfile.mkdtemp(prefix="rm-", dir="/tmp"),  # (the system config is the head's)
        ]
        env = dict(
            os.environ,
            PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            # The token, and not the variable that keeps a loopback address as given: with it `ray start` refuses to
            # start a worker node.
            **(self.head.auth.client_env() if self.head.auth else {}),
        )
        with open(self.data_dir / f"node-{len(self.nodes) + 1}.log", "ab") as log:  # the child has its own copy
            self.nodes.append(
                subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
            )

    def wait_for_resources(self, timeout_s: float = 120, **wanted: float) -> None:
        """Until the cluster reports at least these resources (a loaded machine starts a node slowly)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        seen: dict = {}
        while time.monotonic() < deadline:
            exited = [index + 1 for index, node in enumerate(self.nodes) if node.poll() is not None]
            if exited:
                raise RuntimeError(f"`ray start` of node(s) {exited} exited: see {self.data_dir}/node-N.log")
            try:
                # The State API's REST view of the nodes (this process never joins the cluster).
                reply = httpx.get(
                    f"{self.head.dashboard_url}/api/v0/nodes",
                    params={"limit": 100},
                    headers=self.head.auth.headers() if self.head.auth else None,
                    timeout=5,
                ).json()
                seen = {}
                for node in reply["data"]["result"]["result"]:
                    if node["state"] == "ALIVE":
                        for name, amount in node["resources_total"].items():
                            seen[name] = seen.get(name, 0) + amount
                if all(seen.get(name, 0) >= amount for name, amount in wanted.items()):
                    return
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the cluster reports {seen} after {timeout_s} s, not {wanted}")

    def restart_head(self, down_s: float = 1.0) -> tuple[float, float]:
        """Kill the head's every process, wait down_s, start a new head at the same ports; (Unix time of the kill,
        Unix time the new head's dashboard answered)."""
        port = int(self.head.gcs_address.rsplit(":", 1)[1])
        dashboard_port = urlsplit(self.head.dashboard_url).port
        killed_at = time.time()
        stop_head(self.head, grace_s=0.0)
        time.sleep(down_s)
        self.head = self._start_head(port, dashboard_port)
        return killed_at, time.time()

    def shutdown(self) -> None:
        for node in self.nodes:
            _kill_tree(node)
        stop_head(self.head, grace_s=2.0)
        _kill_tree(self.redis)
