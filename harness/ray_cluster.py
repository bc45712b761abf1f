"""A real local Ray head and a running control plane, for the tests and benchmarks that go through Ray."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.ports import free_port
from ringmaster.api.server import BackgroundServer
from ringmaster.service.client import RingmasterClient
from ringmaster.service.embedded_ray import start_head, stop_head
from ringmaster.service.settings import Settings

CLUSTER_CPUS = 4
REPO_ROOT = Path(__file__).resolve().parents[1]


def leave_ray() -> None:
    """End this process's Ray connection, if any (the server leaves its own; a test may have made another)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def running_control_plane(data_dir: Path, **settings_overrides: Any) -> Iterator[BackgroundServer]:
    """A Ray head with CLUSTER_CPUS CPUs and the API + dispatcher on SQLite, torn down afterwards (this process
    disconnected from Ray before the head stops); ``settings_overrides`` are further Settings fields, or other values
    for the defaults here (e.g. storage_uri, or code_path: the jobs' code, this repository unless given)."""
    # Metrics reach the node's Prometheus endpoint every second (Ray's default: 10 s), so a test sees them.
    head = start_head(data_dir / "ray", num_cpus=CLUSTER_CPUS, system_config={"metrics_report_interval_ms": 1000})
    settings = Settings(**{
        "data_dir": data_dir, "ray_address": head.gcs_address, "ray_dashboard_url": head.dashboard_url,
        "api_port": free_port(), "driver_python": sys.executable, "code_path": str(REPO_ROOT), **settings_overrides,
    })
    try:
        with BackgroundServer(settings) as running:
            running.ray_metrics_url = head.metrics_url
            yield running
    finally:
        leave_ray()
        # A test's head holds nothing worth a graceful stop: its processes get 2 s after SIGTERM (not 10), then SIGKILL.
        stop_head(head, grace_s=2.0)


def wait_for_state(client: RingmasterClient, job_id: str, states: set[str], timeout_s: float = 240,
                   poll_s: float = 0.25) -> dict:
    deadline = time.monotonic() + timeout_s
    while (job := client.job(job_id))["state"] not in states:
        assert time.monotonic() < deadline, f"job {job_id} still {job['state']} after {timeout_s}s"
        time.sleep(poll_s)
    return job
