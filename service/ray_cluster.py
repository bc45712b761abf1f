"""The control plane's client side of Ray: gang reservation, Ray job submission, status, stop, logs.

Imports ray lazily: the API process starts without it until the dispatcher first needs the cluster.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ringmaster.service.naming import NAMESPACE

log = logging.getLogger(__name__)

CONTROL_PLANE_JOB_NAME = "ringmaster control plane (its warm pool workers)"


class ClusterBackend(Protocol):
    """What the dispatcher needs from a cluster; tests substitute a fake."""

    gcs_address: str | None

    def reserve(self, name: str, bundles: list[dict[str, float]], wait_s: float) -> bool: ...
    def release(self, name: str) -> None: ...
    def submit(self, submission_id: str, entrypoint: str, runtime_env: dict[str, Any], metadata: dict[str, str]) -> None: ...
    def status(self, submission_id: str) -> str | None: ...
    def start_failure(self, submission_id: str) -> str | None: ...
    def stop(self, submission_id: str) -> None: ...
    def logs(self, submission_id: str) -> str: ...
    def keep_warm(self, per_node: int, active_submissions: set[str], runtime_envs: dict[str, dict[str, Any]]) -> None: ...


class WarmPool(Protocol):
    """The cluster's pool of idle warm workers (workers/warm_pool.py), topped up by the dispatcher."""

    per_node: int

    def tick(self, active_claimants: set[str], runtime_envs: dict[str, dict[str, Any]]) -> None: ...


# per_node -> a pool keeper; the composition root supplies it (it lives with the workers).
WarmPoolFactory = Callable[[int], WarmPool]


class RayCluster:
    """A Ray cluster reached through its GCS (placement groups) and dashboard (Jobs API)."""

    def __init__(self, address: str, dashboard_url: str, warm_pool_factory: WarmPoolFactory | None = None) -> None:
        """`warm_pool_factory`: builds the warm pool keep_warm tops up; None keeps no pool."""
        self.address = address
        self.dashboard_url = dashboard_url.rstrip("/")
        self._jobs = None
        self._lock = threading.Lock()
        self._warm_pool_factory = warm_pool_factory
        self._warm_pool: WarmPool | None = None
        self._connected = False

    @property
    def gcs_address(self) -> str | None:
        """The GCS address a job's driver joins; None through Ray Client (ray://), where the driver,
        running on the cluster itself, takes the address the Jobs API gives it."""
        return None if self.address.startswith("ray://") else self.address

    def connect(self):
        """Join the cluster as a client; call from the main thread so Ray can install its signal handlers."""
        return self._connect()

    def _connect(self):
        import ray
        import ray.job_config
        from ray.job_submission import JobSubmissionClient

        with self._lock:
            if not self._connected:
                if ray.is_initialized() and ray.get_runtime_context().gcs_address != self.address:
                    # The process is connected to another cluster (Ray allows one connection per process): leave it
                    # rather than place this cluster's jobs there.
                    log.warning("leaving Ray cluster %s to join %s", ray.get_runtime_context().gcs_address, self.address)
                    ray.shutdown()
                if not ray.is_initialized():
                    # Named, as the dashboard's job list shows it: this connection owns the warm pool's workers.
                    ray.init(address=self.address, namespace=NAMESPACE, logging_level=logging.WARNING,
                             log_to_driver=False, configure_logging=False,
                             job_config=ray.job_config.JobConfig(metadata={"job_name": CONTROL_PLANE_JOB_NAME}))
                self._connected = True
            if self._jobs is None:
                self._jobs = JobSubmissionClient(self.dashboard_url)
        return ray, self._jobs

    def disconnect(self) -> None:
        import ray

        with self._lock:
            if self._connected and ray.is_initialized():
                ray.shutdown()
            self._connected = False
            self._jobs = None

    def keep_warm(self, per_node: int, active_submissions: set[str], runtime_envs: dict[str, dict[str, Any]]) -> None:
        """Top up each warm pool (pool -> the runtime_env its workers start in) on every node; kill pool workers whose
        job attempt has ended, and idle workers of pools not named."""
        if self._warm_pool_factory is None:
            return
        _, jobs = self._connect()
        if self._warm_pool is None or self._warm_pool.per_node != per_node:
            self._warm_pool = self._warm_pool_factory(per_node)
        resolved = {}
        for pool, runtime_env in runtime_envs.items():
            runtime_env = copy.deepcopy(runtime_env)
            # An actor's runtime_env takes no local path: the code zip becomes the same content-addressed Ray package
            # the job's own submission uploads (a no-op once the cluster has it), so pool and job share one copy.
            jobs._upload_working_dir_if_needed(runtime_env)
            resolved[pool] = runtime_env
        self._warm_pool.tick(active_submissions, resolved)

    def reserve(self, name: str, bundles: list[dict[str, float]], wait_s: float) -> bool:
        """All-or-nothing: a placement group of these bundles is ready within wait_s, or nothing is held."""
        ray, _ = self._connect()
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group(bundles, strategy="PACK", name=name, lifetime="detached")
        ready, _ = ray.wait([group.ready()], timeout=wait_s)
        if ready:
            return True
        remove_placement_group(group)
        return False

    def release(self, name: str) -> None:
        ray, _ = self._connect()
        from ray.util import get_placement_group
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(get_placement_group(name))
        except ValueError:
            pass  # already removed

    def submit(self, submission_id: str, entrypoint: str, runtime_env: dict[str, Any], metadata: dict[str, str]) -> None:
        """`runtime_env`: Ray's; a local zip as its working_dir is uploaded as a Ray package unless the cluster has it.
        `metadata`: the Ray job's, shown in the dashboard."""
        _, jobs = self._connect()
        # The driver holds no cluster resources of its own: the job's placement group has them all.
        jobs.submit_job(entrypoint=entrypoint, submission_id=submission_id, entrypoint_num_cpus=0, runtime_env=runtime_env,
                        metadata=metadata)

    def status(self, submission_id: str) -> str | None:
        _, jobs = self._connect()
        try:
            return str(jobs.get_job_status(submission_id).value)
        except RuntimeError as error:
            if "does not exist" in str(error):
                return None
            raise

    def start_failure(self, submission_id: str) -> str | None:
        """Why a FAILED Ray job's driver never ran, when it is a failure every attempt would meet: its runtime env could
        not be set up (a pip install failed), its entrypoint could not be started, or it exited by itself with an error
        code (a crash at import). None for a driver killed by a signal, a lost supervisor or node, or any other end."""
        _, jobs = self._connect()
        try:
            info = jobs.get_job_info(submission_id)
        except RuntimeError as error:
            if "does not exist" in str(error):
                return None
            raise
        message = (info.message or "").strip()
        if str(info.status.value) != "FAILED":
            return None
        if info.error_type == "RUNTIME_ENV_SETUP_FAILURE":
            return f"its runtime env could not be set up: {message}"
        if info.error_type == "JOB_ENTRYPOINT_COMMAND_START_ERROR":
            return f"its entrypoint could not be started: {message}"
        code = info.driver_exit_code
        # 1-127: the process exited by itself; a signal shows as a negative code (or 128 + N through a shell).
        if info.error_type == "JOB_ENTRYPOINT_COMMAND_ERROR" and code is not None and 0 < code < 128:
            return message
        return None

    def stop(self, submission_id: str) -> None:
        _, jobs = self._connect()
        try:
            jobs.stop_job(submission_id)
        except RuntimeError as error:
            if "does not exist" not in str(error):
                raise

    def logs(self, submission_id: str) -> str:
        _, jobs = self._connect()
        return jobs.get_job_logs(submission_id)
