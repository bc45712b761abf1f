"""The control plane's client side of Ray: gang reservation, Ray job submission, status, stop, logs.

The Jobs API is Ray's REST API, called from this process; placement groups and the warm pool need a Ray driver,
which runs in the Ray agent's process (service/ray_agent.py), so that no restart of the cluster can take this
process down with it.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, TypedDict

from ringmaster.service.driver_handoff import DriverHandoff
from ringmaster.service.embedded_ray import LOOPBACK, SINGLE_NODE_ENV
from ringmaster.service.errors import DrainRefused, NodeNotFound
from ringmaster.service.ray_agent import AgentUnavailable, ClusterUnreachable, RayAgent, agent_command
from ringmaster.service.ray_auth import RayAuth

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient  # imported where first used: importing Ray takes seconds

log = logging.getLogger(__name__)

# How long a warm pool's code package, once found on the cluster, is taken to be there still. Looking means hashing the
# code zip and asking the dashboard (which logs each answer); a package the cluster lost meanwhile is uploaded again at
# the next look.
POOL_PACKAGE_RECHECK_S = 300.0


class NodeResources(TypedDict):
    """A live node: its total CPUs and GPUs, and what placement groups and actors leave unreserved now."""

    id: str
    CPU: float
    GPU: float
    free_CPU: float
    free_GPU: float
    # Ray drains it (a spot notice, maintenance): nothing new goes there, and its jobs move off. The deadline by which
    # it goes, in seconds since the epoch (None: none given).
    draining: NotRequired[bool]
    drain_deadline: NotRequired[float | None]


class ClusterView(TypedDict):
    """One read of the cluster for a scheduling pass: its live nodes, and the node of each bundle of the placement
    groups asked about (a group that does not exist is absent; a bundle not placed now is None)."""

    nodes: list[NodeResources]
    groups: dict[str, list[str | None]]


class ClusterBackend(Protocol):
    """What the dispatcher needs from a cluster; tests substitute a fake."""

    @property
    def gcs_address(self) -> str | None: ...

    def reserve(self, name: str, bundles: list[dict[str, float]], wait_s: float) -> bool: ...
    def release(self, name: str) -> None: ...
    def submit(
        self,
        submission_id: str,
        entrypoint: str,
        runtime_env: dict[str, Any],
        metadata: dict[str, str],
        handoff: DriverHandoff,
    ) -> None: ...
    def status(self, submission_id: str) -> str | None: ...
    def start_failure(self, submission_id: str) -> str | None: ...
    def stop(self, submission_id: str) -> None: ...
    def logs(self, submission_id: str) -> str: ...
    def keep_warm(
        self, per_node: int, active_submissions: set[str], runtime_envs: dict[str, dict[str, Any]]
    ) -> None: ...
    def node_capacities(self) -> list[dict[str, float]]: ...
    def cluster_view(self, groups: list[str]) -> ClusterView: ...
    def request_resources(self, bundles: list[dict[str, float]]) -> None: ...
    def draining_nodes(self) -> dict[str, float | None]: ...
    def drain_node(self, node_id: str, deadline: float | None, reason: str) -> None: ...


class RayCluster:
    """A Ray cluster reached through its dashboard (Jobs API) and, for placement groups and the warm pool, the Ray
    agent's own connection to its GCS."""

    def __init__(
        self,
        address: str,
        dashboard_url: str,
        agent: list[str] | None = None,
        driver_resources: dict[str, float] | None = None,
        auth: RayAuth | None = None,
    ) -> None:
        """`agent`: the command that starts the Ray agent (the composition root's adds the warm pool); by default one
        that keeps no pool. `driver_resources`: what each job's driver asks Ray for (Settings.driver_resources).
        `auth`: the cluster's token (Settings.ray_auth), for the Jobs API's calls and the agent's ray.init."""
        self.address = address
        self.driver_resources = dict(driver_resources or {})
        self.dashboard_url = dashboard_url.rstrip("/")
        self.auth = auth
        # The agent's environment: this process's, with its own Ray token variables (if any) replaced by auth's.
        inherited = {key: value for key, value in os.environ.items() if auth is None or not key.startswith("RAY_AUTH_")}
        self.agent = RayAgent(
            agent or agent_command("ringmaster.service.ray_agent", address),
            env={**inherited, **ray_client_env(address, auth)},
        )
        self._jobs: JobSubmissionClient | None = None
        self._lock = threading.Lock()
        self._pool_envs: dict[
            str, tuple[str, float, dict[str, Any]]
        ] = {}  # pool -> (its env, checked at, as Ray takes it)

    @property
    def gcs_address(self) -> str | None:
        """The GCS address a job's driver joins; None through Ray Client (ray://), where the driver,
        running on the cluster itself, takes the address the Jobs API gives it."""
        return None if self.address.startswith("ray://") else self.address

    def connect(self) -> None:
        """Start the Ray agent now rather than at the first reservation; a cluster that does not answer yet is
        joined later (each call tries again)."""
        try:
            self._agent_call("ping")
        except RuntimeError as error:
            log.warning("the Ray cluster at %s is not reachable yet (tried again on use): %s", self.address, error)

    def _jobs_api(self) -> _JobsApi:
        from ray.job_submission import JobSubmissionClient

        with self._lock:
            if self._jobs is None:
                try:
                    # The token as a header of this client alone: this process may call several clusters.
                    headers = self.auth.headers() if self.auth else None
                    self._jobs = JobSubmissionClient(self.dashboard_url, headers=headers)
                except ConnectionError as error:  # the client checks the dashboard's version at once
                    raise ClusterUnreachable(
                        f"the Ray dashboard at {self.dashboard_url} does not answer: {error}"
                    ) from error
        return _JobsApi(self._jobs, self.dashboard_url)

    def disconnect(self) -> None:
        self.agent.close()
        with self._lock:
            self._jobs = None
        self._pool_envs.clear()

    def keep_warm(self, per_node: int, active_submissions: set[str], runtime_envs: dict[str, dict[str, Any]]) -> None:
        """Top up each warm pool (pool -> the runtime_env its workers start in) on every node; kill pool workers whose
        job attempt has ended, and idle workers of pools not named."""
        resolved = {pool: self._pool_runtime_env(pool, runtime_env) for pool, runtime_env in runtime_envs.items()}
        self._pool_envs = {pool: entry for pool, entry in self._pool_envs.items() if pool in runtime_envs}
        self._agent_call(
            "keep_warm", per_node=per_node, active_submissions=sorted(active_submissions), runtime_envs=resolved
        )

    def _pool_runtime_env(self, pool: str, runtime_env: dict[str, Any]) -> dict[str, Any]:
        """The pool's runtime_env as an actor takes it, which is no local path: the code zip becomes the same
        content-addressed Ray package the job's own submission uploads (uploaded unless the cluster has it), so pool
        and job share one copy. Looked up again only every POOL_PACKAGE_RECHECK_S, not at every tick."""
        key = json.dumps(runtime_env, sort_keys=True)
        cached = self._pool_envs.get(pool)
        if cached is not None and cached[0] == key and time.monotonic() - cached[1] < POOL_PACKAGE_RECHECK_S:
            return cached[2]
        resolved = copy.deepcopy(runtime_env)
        self._jobs_api()._upload_working_dir_if_needed(resolved)
        self._pool_envs[pool] = (key, time.monotonic(), resolved)
        return resolved

    def reserve(self, name: str, bundles: list[dict[str, float]], wait_s: float) -> bool:
        """All-or-nothing: a placement group of these bundles is ready within wait_s, or nothing is held."""
        return bool(self._agent_call("reserve", timeout_s=wait_s + 60, name=name, bundles=bundles, wait_s=wait_s))

    def release(self, name: str) -> None:
        self._agent_call("release", name=name)

    def node_capacities(self) -> list[dict[str, float]]:
        """Each live node's total CPUs and GPUs."""
        return list(self._agent_call("node_capacities"))

    def cluster_view(self, groups: list[str]) -> ClusterView:
        view: ClusterView = self._agent_call("cluster_view", groups=groups)
        return view

    def request_resources(self, bundles: list[dict[str, float]]) -> None:
        self._agent_call("request_resources", bundles=bundles)

    def draining_nodes(self) -> dict[str, float | None]:
        """The nodes Ray drains, each with its deadline (seconds since the epoch; None: none given)."""
        return dict(self._agent_call("draining_nodes"))

    def drain_node(self, node_id: str, deadline: float | None, reason: str) -> None:
        """Have Ray drain the node; NodeNotFound when no live node has that id, DrainRefused when Ray says no."""
        answer = self._agent_call("drain_node", node_id=node_id, deadline=deadline, reason=reason)
        if answer["unknown"]:
            raise NodeNotFound(answer["refused"])
        if answer["refused"]:
            raise DrainRefused(f"Ray refused to drain node {node_id}: {answer['refused']}")

    def _agent_call(self, op: str, **args: Any) -> Any:
        if not self.agent.running and (why := _unreachable(self.address)):
            # Not worth an agent's start (seconds) and its wait to join: the cluster is down or restarting.
            raise AgentUnavailable(why)
        return self.agent.call(op, **args)

    def submit(
        self,
        submission_id: str,
        entrypoint: str,
        runtime_env: dict[str, Any],
        metadata: dict[str, str],
        handoff: DriverHandoff,
    ) -> None:
        """`runtime_env`: Ray's; a local zip as its working_dir is uploaded as a Ray package unless the cluster has it.
        `metadata`: the Ray job's, shown in the dashboard. `handoff`: the driver's secret and spec, which go through
        the agent into the GCS (service/driver_handoff.py), never into the Jobs API."""
        jobs = self._jobs_api()
        self._agent_call("put_driver_handoff", submission_id=submission_id, handoff=handoff.to_json())
        try:
            # The driver holds no CPU of its own (the job's placement group has them all); driver_resources only say
            # where it may run.
            jobs.submit_job(
                entrypoint=entrypoint,
                submission_id=submission_id,
                entrypoint_num_cpus=0,
                runtime_env=runtime_env,
                metadata=metadata,
                entrypoint_resources=self.driver_resources or None,
            )
        except Exception:
            try:
                self._agent_call("drop_driver_handoff", submission_id=submission_id)
            except Exception as error:  # dropped again when the attempt is closed (stop)
                log.warning("refused Ray job %s: its handoff stays until its attempt closes: %s", submission_id, error)
            raise

    def status(self, submission_id: str) -> str | None:
        jobs = self._jobs_api()
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
        jobs = self._jobs_api()
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
            log.warning("Ray job %s: its runtime env could not be set up: %s", submission_id, message)
            return f"its runtime env could not be set up: {runtime_env_failure_reason(message)}"
        if info.error_type == "JOB_ENTRYPOINT_COMMAND_START_ERROR":
            return f"its entrypoint could not be started: {message}"
        code = info.driver_exit_code
        # 1-127: the process exited by itself; a signal shows as a negative code (or 128 + N through a shell).
        if info.error_type == "JOB_ENTRYPOINT_COMMAND_ERROR" and code is not None and 0 < code < 128:
            return message
        return None

    def stop(self, submission_id: str) -> None:
        """Stop the Ray job, and drop its driver's handoff if the driver never took it."""
        jobs = self._jobs_api()
        try:
            jobs.stop_job(submission_id)
        except RuntimeError as error:
            if "does not exist" not in str(error):
                raise
        self._agent_call("drop_driver_handoff", submission_id=submission_id)

    def logs(self, submission_id: str) -> str:
        jobs = self._jobs_api()
        logs: str = jobs.get_job_logs(submission_id)  # _JobsApi passes the client's calls on untyped
        return logs


def ray_client_env(address: str, auth: RayAuth | None) -> dict[str, str]:
    """The variables a Ray client process (ray.init) of the cluster at address needs: the token's, and for a GCS on
    loopback, the one that keeps Ray from trading that address for the machine's own, where a loopback-only head does
    not listen (for a head that listens everywhere, the address as given works as well)."""
    env = auth.client_env() if auth is not None else {}
    if "://" not in address and address.rpartition(":")[0] in (LOOPBACK, "localhost"):
        env.update(SINGLE_NODE_ENV)
    return env


def _unreachable(address: str) -> str | None:
    """Why nothing can join the GCS at host:port now (None if it accepts connections, or for a ray:// address)."""
    if "://" in address:
        return None
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return None
    except (OSError, ValueError) as error:
        return f"nothing answers at the Ray cluster's address {address}: {error}"


class _JobsApi:
    """The Jobs API client, whose calls raise ClusterUnreachable when the dashboard does not answer at all."""

    def __init__(self, jobs: Any, dashboard_url: str) -> None:
        self._jobs, self._dashboard_url = jobs, dashboard_url

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._jobs, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            import requests

            try:
                return attribute(*args, **kwargs)
            except requests.exceptions.ConnectionError as error:
                raise ClusterUnreachable(f"the Ray dashboard at {self._dashboard_url} does not answer") from error

        return call


_PIP_ERROR = re.compile(r"^\s*ERROR: (.+?)\s*$", re.MULTILINE)


def runtime_env_failure_reason(message: str) -> str:
    """The reason in Ray's account of a runtime env that could not be set up, which wraps it in the agent's
    traceback: pip's own ERROR lines where pip failed, else the exception the traceback ends in (the whole account
    goes to the control plane's log)."""
    pip_errors = _PIP_ERROR.findall(message)
    if pip_errors:
        return "pip install failed: " + "; ".join(pip_errors)
    _, traceback, after = message.rpartition("Traceback (most recent call last):")
    # The traceback's frames are indented; the first line that is not is the exception's.
    exception = next((line for line in after.splitlines() if line.strip() and not line[0].isspace()), None)
    return exception.strip() if traceback and exception else message
