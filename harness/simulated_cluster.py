"""A multi-node Ray cluster on one machine (ray.cluster_utils.Cluster) with a control plane on it.

Nodes carry one CPU each, so a 2-worker job spans two nodes. Killing a node SIGKILLs its raylet
and every process under it, as a machine dying would; freezing SIGSTOPs them. Ray's health checks
are tightened as ringmaster's embedded head tightens them.

Nodes given GPUs take this machine's CUDA devices round robin (a node's CUDA_VISIBLE_DEVICES, which Ray
maps its GPU ids through), so a machine with fewer devices than the nodes carry shares them. Each such
node is a host of its own to NCCL too (NCCL_HOSTID), as it is to Ray: NCCL refuses two ranks of one
communicator on one device of one host, and between hosts it talks over its network transport (sockets
here), never the device-to-device paths a real multi-GPU node would use.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ray._common.utils import get_default_ray_temp_dir
from ray.cluster_utils import Cluster

from harness.local_control_plane import REPO_ROOT, leave_ray
from harness.ports import free_port
from ringmaster.api.server import BackgroundServer
from ringmaster.service.embedded_ray import CLUSTER_SYSTEM_CONFIG
from ringmaster.service.settings import Settings
from ringmaster.workers.data.audit import read_steps_by_generation


def _descendants(pid: int) -> list[int]:
    """Every process below pid, read from /proc (children before their own children)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(parent, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found.extend(children)
        frontier.extend(children)
    return found


@contextmanager
def _own_metrics_ports() -> Iterator[None]:
    """Free ports for the head's dashboard and autoscaler monitor metrics, which this process starts, as the embedded
    head has (service/embedded_ray.py): on Ray's fixed ones (44227, 44217), held by another head on this machine, its
    dashboard never comes up ('Module MetricsHead failed to start')."""
    chosen = {"DASHBOARD_METRIC_PORT": str(free_port()), "AUTOSCALER_METRIC_PORT": str(free_port())}
    before = {name: os.environ.get(name) for name in chosen}
    os.environ.update({name: port for name, port in chosen.items() if before[name] is None})
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)


class SimulatedCluster:
    def __init__(
        self, nodes: int, cpus_per_node: int = 1, gpus_per_node: int = 0, *, logical_gpus: bool = False
    ) -> None:
        """`logical_gpus`: Ray counts and assigns the nodes' GPUs, but none is a device here (no CUDA needed)."""
        self.dashboard_port = free_port()
        # Its own temp dir, so "auto" addresses inside it never resolve to another cluster here.
        self.temp_dir = tempfile.mkdtemp(prefix="rm-", dir="/tmp")
        # Cluster also records the head's address in Ray's default temp dir (/tmp/ray/ray_current_cluster), which a
        # fresh machine does not have yet.
        os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
        with _own_metrics_ports():
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": 0,
                    "temp_dir": self.temp_dir,
                    "include_dashboard": True,
                    "dashboard_host": "127.0.0.1",
                    "dashboard_port": self.dashboard_port,
                    # 0: a port the kernel hands each agent, as the embedded head's (service/embedded_ray.py). Ray's
                    # fixed one (52365) may be held by another cluster's agent here (the other xdist group's): the
                    # Jobs API then finds no agent to submit through ("No available agent to submit job").
                    "dashboard_agent_listen_port": 0,
                    "_system_config": CLUSTER_SYSTEM_CONFIG,
                },
            )
        self.cpus_per_node, self.gpus_per_node = cpus_per_node, gpus_per_node
        self.logical_gpus = logical_gpus
        self._nodes_added = 0
        self.nodes = [self.add_node() for _ in range(nodes)]

    @property
    def gcs_address(self) -> str:
        return self.cluster.gcs_address

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def add_node(self):
        node = self.cluster.add_node(
            num_cpus=self.cpus_per_node,
            num_gpus=self.gpus_per_node,
            env_vars=None if self.logical_gpus else self._gpu_node_env(self._nodes_added),
            dashboard_agent_listen_port=0,  # as the head's (below)
        )
        self._nodes_added += 1
        self.cluster.wait_for_nodes()
        return node

    def _gpu_node_env(self, index: int) -> dict[str, str] | None:
        if not self.gpus_per_node:
            return None
        import torch

        devices = torch.cuda.device_count()
        if devices == 0:
            raise RuntimeError(f"simulated nodes with {self.gpus_per_node} GPU(s) each need a CUDA device here")
        first = index * self.gpus_per_node
        visible = [str((first + k) % devices) for k in range(self.gpus_per_node)]
        return {"CUDA_VISIBLE_DEVICES": ",".join(visible), "NCCL_HOSTID": f"simulated-node-{index}"}

    def ensure_nodes(self, count: int) -> None:
        """Add nodes until `count` with CPUs are alive: earlier tests kill nodes, and each starts with what it needs."""
        from ray.util.state import list_nodes

        while (
            sum(
                1
                for node in list_nodes(
                    address=self.dashboard_url, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False
                )
                if node.resources_total.get("CPU")
            )
            < count
        ):
            self.add_node()

    def node_by_id(self, node_id: str):
        return next(node for node in self.cluster.worker_nodes if node.node_id == node_id)

    def _node_processes(self, node) -> list[int]:
        raylet = node.all_processes["raylet"][0].process.pid
        return [raylet, *_descendants(raylet)]

    def kill_node(self, node) -> None:
        """The machine dies: every process on it is gone at once. All are stopped before any is killed (the raylet
        first): a raylet that outlived its workers by a moment would report their deaths as crashes on a live node."""
        self.kill_nodes([node])

    def kill_nodes(self, nodes: list) -> None:
        """The machines die together: every process on any of them is stopped before any is killed, and each node
        is removed from the cluster only then (a removal takes a moment: nodes killed one after another die that
        far apart, and the job may see the first loss alone)."""
        processes = [pid for node in nodes for pid in self._node_processes(node)]
        for sent in (signal.SIGSTOP, signal.SIGKILL):
            for pid in processes:
                try:
                    os.kill(pid, sent)
                except ProcessLookupError:
                    pass
        for node in nodes:
            self.cluster.remove_node(node, allow_graceful=False)

    def freeze_node(self, node) -> list[int]:
        """The machine hangs: its processes stop but hold their sockets open."""
        frozen = self._node_processes(node)
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        return frozen

    def shutdown(self) -> None:
        for node in list(self.cluster.worker_nodes):
            for pid in self._node_processes(node):
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        self.cluster.shutdown()


@contextmanager
def control_plane_on(
    cluster: SimulatedCluster, data_dir: Path, warm_workers_per_node: int = 0
) -> Iterator[BackgroundServer]:
    """The control plane on this cluster; without a warm pool unless asked (the elastic tests measure the job's own
    recovery: pool workers on idle nodes would also be TrainWorker actors on nodes the job does not use)."""
    settings = Settings(
        data_dir=data_dir,
        ray_address=cluster.gcs_address,
        ray_dashboard_url=cluster.dashboard_url,
        api_port=free_port(),
        driver_python=sys.executable,
        code_path=str(REPO_ROOT),
        warm_workers_per_node=warm_workers_per_node,
    )
    try:
        with BackgroundServer(settings) as server:
            yield server
    finally:
        leave_ray()


@contextmanager
def served_cluster(nodes: int, data_dir: Path, cpus_per_node: int = 1) -> Iterator[SimulatedCluster]:
    """A simulated cluster with the control plane on it, torn down afterwards; `.client` is an API client and
    `.storage` the checkpoint storage's local path."""
    simulated = SimulatedCluster(nodes=nodes, cpus_per_node=cpus_per_node)
    try:
        with control_plane_on(simulated, data_dir) as server:
            simulated.client = server.client()
            simulated.storage = Path(server.plane.settings.resolved_storage_uri())
            yield simulated
    finally:
        simulated.shutdown()


def newest_recorded_step(storage_root: Path) -> int:
    """The newest step any rank of the job has recorded in its own step record (train.record_sample_ids), 0 if none."""
    return max((step for steps in read_steps_by_generation(storage_root).values() for step in steps), default=0)


def wait_for_recorded_step(storage_root: Path, step: int, timeout_s: float = 240) -> int:
    """Until a rank of the job has recorded `step` or a later one in its own step record, which it writes as each
    step ends (the metrics reach the API only when the driver drains them, every second: a job of short steps can
    end before its metrics show the step a test waits for). Returns the newest step recorded then."""
    deadline = time.monotonic() + timeout_s
    while (newest := newest_recorded_step(storage_root)) < step:
        assert time.monotonic() < deadline, f"no rank recorded step {step} under {storage_root}"
        time.sleep(0.01)
    return newest


def wait_for_step(client, job_id: str, step: int, timeout_s: float = 240) -> None:
    """Until the job has reported a metric at `step` or later."""
    deadline = time.monotonic() + timeout_s
    while not any(row["step"] >= step for row in client.metrics(job_id)["items"]):
        assert time.monotonic() < deadline, f"job {job_id} never reached step {step}"
        time.sleep(0.05)
