"""A stand-in for the cluster the dispatcher drives: service/ray_cluster.py's ClusterBackend without Ray.

Placement groups are all-or-nothing against a fixed number of CPUs (or always fit), each submission becomes a "Ray
job" whose state the caller sets in ``ray_status``, and every call is recorded for tests to read back. Optionally a
thread plays each job's driver, reporting RUNNING then SUCCEEDED at once, as a very quick driver would.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ringmaster.service import jobs
from ringmaster.service.db import session_scope
from ringmaster.service.driver_handoff import DriverHandoff
from ringmaster.service.naming import submission_id_for
from ringmaster.service.ray_cluster import ClusterView, NodeResources
from ringmaster.service.reports import DriverReport

STANDIN_NODE = "standin-node"
STANDIN_UNBOUNDED_CPUS = 1_000_000  # "always room": more CPUs than any test's jobs ask for


def job_attempt(submission_id: str) -> tuple[str, int]:
    """The job id and attempt number a submission id was derived from (service.naming.submission_id_for)."""
    job_id, attempt = submission_id.removeprefix("ringmaster-").rsplit("-", 1)
    if submission_id_for(job_id, int(attempt)) != submission_id:
        raise ValueError(f"not a ringmaster submission id: {submission_id}")
    return job_id, int(attempt)


def finish_at_once(session: Session, submission_id: str) -> None:
    """The attempt's driver reports RUNNING, then SUCCEEDED, through service.jobs (in the caller's transaction)."""
    job_id, attempt = job_attempt(submission_id)
    for seq, state in enumerate(("RUNNING", "SUCCEEDED"), start=1):
        jobs.apply_driver_report(session, job_id, attempt, DriverReport(seq=seq, state=state))


class StandInCluster:
    """A ClusterBackend that records what the dispatcher asks of it.

    ``cpus``: the cluster's size; None always has room. ``drivers``: when given, a thread finishes each submitted
    job at once on these sessions (finish_at_once), so finished jobs leave the active set; close() stops it.
    """

    gcs_address: str | None = None

    def __init__(self, cpus: int | None = None, *, drivers: sessionmaker[Session] | None = None) -> None:
        self.free_cpus = cpus
        self.total_cpus = cpus
        self.groups: dict[str, int] = {}  # placement group name -> CPUs it holds
        self.group_bundles: dict[str, int] = {}  # placement group name -> its bundle count
        self.submitted: dict[str, str] = {}  # submission id -> entrypoint
        self.runtime_envs: dict[str, dict[str, Any]] = {}  # submission id -> its runtime_env
        self.metadata: dict[str, dict[str, str]] = {}  # submission id -> the Ray job's metadata
        self.handoffs: dict[str, DriverHandoff] = {}  # submission id -> its driver's handoff, until the attempt closes
        self.ray_status: dict[str, str] = {}  # submission id -> the Ray job's state
        self.start_failures: dict[str, str] = {}  # submission id -> why its driver never started (set with FAILED)
        self.stopped: list[str] = []
        self.refuse_submit: bool | str = False  # True: submit raises, as an unreachable Jobs API does; a str: with it
        self.duplicates: list[str] = []  # submission ids submitted more than once
        self.warm_pool_calls: list[tuple[int, set[str]]] = []
        self.warm_pool_envs: dict[str, dict[str, Any]] = {}  # the pools asked for by the latest keep_warm
        self.status_calls: list[str] = []
        self.resource_requests: list[list[dict[str, float]]] = []  # each request_resources call's bundles
        self.draining: dict[str, float | None] = {}  # node id -> its drain deadline, as Ray reports drains
        self.drain_checks = 0
        self._lock = threading.Lock()
        self._drivers = drivers
        self._driver_thread: threading.Thread | None = None
        self._to_finish: queue.Queue[str | None] = queue.Queue()
        if drivers is not None:
            self._driver_thread = threading.Thread(target=self._drive, name="stand-in-drivers", daemon=True)
            self._driver_thread.start()

    def reserve(self, name: str, bundles: list[dict[str, float]], wait_s: float) -> bool:
        need = int(sum(bundle.get("CPU", 0) for bundle in bundles))
        with self._lock:
            if self.free_cpus is not None:
                if need > self.free_cpus:
                    return False
                self.free_cpus -= need
            self.groups[name] = need
            self.group_bundles[name] = len(bundles)
        return True

    def node_capacities(self) -> list[dict[str, float]]:
        """One node of all the CPUs (none with None: room is never short there)."""
        return [] if self.total_cpus is None else [{"CPU": float(self.total_cpus), "GPU": 0.0}]

    def cluster_view(self, groups: list[str]) -> ClusterView:
        """One node of all the CPUs (with None, of more than any test asks for) and more GPUs than any test asks for,
        every group's bundles on it."""
        total = float(STANDIN_UNBOUNDED_CPUS if self.total_cpus is None else self.total_cpus)
        free = float(STANDIN_UNBOUNDED_CPUS if self.free_cpus is None else self.free_cpus)
        gpus = float(STANDIN_UNBOUNDED_CPUS)  # GPU bundles always fit here (reserve counts CPUs alone)
        node = NodeResources(id=STANDIN_NODE, CPU=total, GPU=gpus, free_CPU=free, free_GPU=gpus)
        with self._lock:
            held = {name: self.group_bundles[name] for name in groups if name in self.groups}
        return ClusterView(nodes=[node], groups={name: [STANDIN_NODE] * count for name, count in held.items()})

    def request_resources(self, bundles: list[dict[str, float]]) -> None:
        self.resource_requests.append(bundles)

    def draining_nodes(self) -> dict[str, float | None]:
        self.drain_checks += 1
        return dict(self.draining)

    def drain_node(self, node_id: str, deadline: float | None, reason: str) -> None:
        self.draining[node_id] = deadline

    def release(self, name: str) -> None:
        with self._lock:
            held = self.groups.pop(name, 0)
            self.group_bundles.pop(name, None)
            if self.free_cpus is not None:
                self.free_cpus += held

    def submit(
        self,
        submission_id: str,
        entrypoint: str,
        runtime_env: dict[str, Any],
        metadata: dict[str, str],
        handoff: DriverHandoff,
    ) -> None:
        if self.refuse_submit:
            raise RuntimeError(self.refuse_submit if isinstance(self.refuse_submit, str) else "Jobs API unavailable")
        if submission_id in self.submitted:
            self.duplicates.append(submission_id)
        self.submitted[submission_id] = entrypoint
        self.runtime_envs[submission_id] = runtime_env
        self.metadata[submission_id] = metadata
        self.handoffs[submission_id] = handoff
        self.ray_status[submission_id] = "RUNNING"
        if self._drivers is not None:
            self._to_finish.put(submission_id)

    def status(self, submission_id: str) -> str | None:
        self.status_calls.append(submission_id)
        return self.ray_status.get(submission_id)

    def start_failure(self, submission_id: str) -> str | None:
        return self.start_failures.get(submission_id) if self.ray_status.get(submission_id) == "FAILED" else None

    def stop(self, submission_id: str) -> None:
        self.stopped.append(submission_id)
        self.handoffs.pop(submission_id, None)  # as RayCluster drops a handoff no driver took
        if submission_id in self.ray_status:
            self.ray_status[submission_id] = "STOPPED"

    def logs(self, submission_id: str) -> str:
        return f"log of {submission_id}"

    def keep_warm(self, per_node: int, active_submissions: set[str], runtime_envs: dict[str, dict[str, Any]]) -> None:
        self.warm_pool_calls.append((per_node, set(active_submissions)))
        self.warm_pool_envs = runtime_envs

    def close(self) -> None:
        """Stop the driver thread (when there is one) once it has finished the jobs submitted so far."""
        if self._driver_thread is not None:
            self._to_finish.put(None)
            self._driver_thread.join(timeout=30)

    def _drive(self) -> None:
        assert self._drivers is not None
        while (submission_id := self._to_finish.get()) is not None:
            with session_scope(self._drivers) as session:
                finish_at_once(session, submission_id)
            self.ray_status[submission_id] = "SUCCEEDED"
