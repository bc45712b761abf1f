"""A real local Ray head and a running control plane, for the tests and benchmarks that go through Ray."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from harness.ports import free_port
from ringmaster.api.server import BackgroundServer
from ringmaster.service.client import RingmasterClient
from ringmaster.service.embedded_ray import RayHead, start_head, stop_head
from ringmaster.service.ray_cluster import ray_client_env
from ringmaster.service.settings import Settings

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

CLUSTER_CPUS = 4
REPO_ROOT = Path(__file__).resolve().parents[1]


class Cluster(Protocol):
    """A Ray cluster this process can join: a RayHead (with its token), or a test cluster without authentication."""

    @property
    def gcs_address(self) -> str: ...


# What join_ray put in this process's environment, and what it found there, so leave_ray can put it back.
_joined_env: dict[str, str | None] = {}


def join_ray(cluster: Cluster, **init_args: Any) -> None:
    """ray.init this process into the cluster, with the environment a Ray client of it needs (the head's token, the
    loopback address kept): set for as long as the connection lasts, since Ray reads the token at each call. Only a
    test process does this; the control plane keeps its token out of its own environment (its agent has it)."""
    import ray
    from ray._private import ray_constants

    leave_ray()
    wanted = ray_client_env(cluster.gcs_address, cluster.auth if isinstance(cluster, RayHead) else None)
    _joined_env.update({name: os.environ.get(name) for name in wanted})
    os.environ.update(wanted)
    _reload_ray_auth()
    # Ray read the variable of SINGLE_NODE_ENV when it was imported: what it would have made of it.
    ray_constants.ENABLE_RAY_CLUSTER = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1") != "0"
    ray.init(address=cluster.gcs_address, **init_args)


def leave_ray() -> None:
    """End this process's Ray connection, if any (the server leaves its own; a test may have made another), and put
    back the environment join_ray changed."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    if _joined_env:
        from ray._private import ray_constants

        for name, value in _joined_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _joined_env.clear()
        _reload_ray_auth()
        ray_constants.ENABLE_RAY_CLUSTER = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1") != "0"


def _reload_ray_auth() -> None:
    """Have Ray read RAY_AUTH_* again: it caches the mode (its config) and the token (its loader)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    AuthenticationTokenLoader.instance().reset_cache()
    Config.initialize("")


def watch_cluster(head: Cluster) -> None:
    """Join the head from this process, in the control plane's namespace, so a test can look at the cluster (its
    resources, the warm pool's named workers); the control plane itself joins only from its Ray agent's process."""
    from ringmaster.service.naming import NAMESPACE

    join_ray(head, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING")


def jobs_api(head: RayHead) -> JobSubmissionClient:
    """Ray's Jobs API client for the head, with its token."""
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(head.dashboard_url, headers=head.auth.headers() if head.auth else None)


def start_test_head(data_dir: Path) -> RayHead:
    """A Ray head with CLUSTER_CPUS CPUs whose metrics reach the node's Prometheus endpoint every second (Ray's
    default: 10 s), so a test sees them."""
    return start_head(data_dir, num_cpus=CLUSTER_CPUS, system_config={"metrics_report_interval_ms": 1000})


def stop_test_head(head: RayHead) -> None:
    # A test's head holds nothing worth a graceful stop: its processes get 2 s after SIGTERM (not 10), then SIGKILL.
    stop_head(head, grace_s=2.0)


def clear_head(head: RayHead, timeout_s: float = 60) -> None:
    """Leave a head as a new one is: stop the Ray jobs a control plane left on it, kill the named actors (its warm
    pool's detached workers among them), remove every placement group, and wait for all its CPUs to be free."""
    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    jobs = jobs_api(head)

    def unfinished() -> list[str]:
        return [
            job.submission_id
            for job in jobs.list_jobs()
            if job.submission_id is not None and not job.status.is_terminal()
        ]

    for submission_id in unfinished():
        jobs.stop_job(submission_id)
    join_ray(head, log_to_driver=False)
    try:
        for actor in ray.util.list_named_actors(all_namespaces=True):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
            except ValueError:  # gone meanwhile
                pass
        for group_id, group in placement_group_table().items():
            if group["state"] != "REMOVED":
                remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(group_id)))
        deadline = time.monotonic() + timeout_s
        while ray.available_resources().get("CPU", 0) < CLUSTER_CPUS or unfinished():
            assert time.monotonic() < deadline, f"the shared head is still busy: {ray.available_resources()}"
            time.sleep(0.2)
    finally:
        leave_ray()


def running_control_plane(
    data_dir: Path, head: RayHead | None = None, **settings_overrides: Any
) -> Iterator[BackgroundServer]:
    """The API + dispatcher on SQLite on a Ray head (a new one unless given: a shared head is cleared afterwards,
    clear_head), torn down afterwards, this process disconnected from Ray; ``settings_overrides`` are further
    Settings fields, or other values for the defaults here (e.g. storage_uri, or code_path: the jobs' code, this
    repository unless given)."""
    own_head = head is None
    if head is None:
        head = start_test_head(data_dir / "ray")
    settings = Settings(
        **{
            "data_dir": data_dir,
            "ray_address": head.gcs_address,
            "ray_dashboard_url": head.dashboard_url,
            "ray_auth_token_file": head.auth and head.auth.token_path,
            "api_port": free_port(),
            "driver_python": sys.executable,
            "code_path": str(REPO_ROOT),
            **settings_overrides,
        }
    )
    try:
        with BackgroundServer(settings) as running:
            running.ray_metrics_url = head.metrics_url
            watch_cluster(head)
            yield running
    finally:
        leave_ray()
        if own_head:
            stop_test_head(head)
        else:
            clear_head(head)


def wait_for_state(
    client: RingmasterClient, job_id: str, states: set[str], timeout_s: float = 240, poll_s: float = 0.25
) -> dict:
    deadline = time.monotonic() + timeout_s
    while (job := client.job(job_id))["state"] not in states:
        assert time.monotonic() < deadline, f"job {job_id} still {job['state']} after {timeout_s}s"
        time.sleep(poll_s)
    return job
