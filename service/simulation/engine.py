"""The discrete-event loop: a simulated clock that jumps from event to event (arrivals, completions, scheduling
passes), hands the scheduler's plan function the cluster as it stands at each pass, and carries out its decisions
through the job model. Nothing here waits on a real clock."""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

from ringmaster.service.scheduling.fair_share import FairShareLedger, Held
from ringmaster.service.scheduling.model import (
    NodeView,
    Plan,
    PolicyName,
    QueuedJob,
    RunningJob,
    SchedulingInput,
    TenantView,
    WorkerShape,
)
from ringmaster.service.simulation.errors import SimulationInputError
from ringmaster.service.simulation.settings import SimulationSettings
from ringmaster.service.simulation.trace import TraceJob

Planner = Callable[[SchedulingInput], Plan]
ProgressCallback = Callable[[int], None]

# A simulated worker holds one GPU and no CPUs, as a GPU worker's Ray bundle asks (service.naming.worker_bundles).
GPU_WORKER = WorkerShape(gpus=1, cpus=0.0)


class PlanViolation(RuntimeError):
    """The plan asked for something the cluster cannot do (a node over its capacity, a job in the wrong state, a size
    outside its bounds): a fault of the plan function, which the simulator reports rather than papers over."""


@dataclass(frozen=True, slots=True)
class ClusterShape:
    nodes: int
    gpus_per_node: int
    cpus_per_node: float = 0.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or self.cpus_per_node < 0:
            raise SimulationInputError(
                f"a cluster has ≥ 1 node of ≥ 1 GPU and ≥ 0 CPUs, got {self.nodes} × {self.gpus_per_node} GPUs, "
                f"{self.cpus_per_node} CPUs"
            )

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, slots=True)
class JobOutcome:
    job_id: str
    tenant: str
    gpus: int
    duration: float
    submitted_at: float
    first_started_at: float
    finished_at: float
    waited_s: float  # every second it spent queued, before its first start and after each preemption
    preemptions: int
    shrinks: int
    grows: int
    lost_s: float  # seconds of running thrown away by preemptions (since a checkpoint)

    @property
    def completion_time(self) -> float:
        return self.finished_at - self.submitted_at


@dataclass(frozen=True, slots=True)
class SimulationRun:
    """What one policy did with one trace: each job's outcome, the cluster over time, and the plan's cost."""

    policy: PolicyName
    cluster: ClusterShape
    jobs: tuple[JobOutcome, ...]
    # (time, GPUs held by jobs, jobs queued) after each change
    timeline: tuple[tuple[float, int, int], ...]
    tenant_gpu_seconds: dict[str, float]
    tenant_weights: dict[str, float]
    decision_cpu_ms: tuple[float, ...]  # the plan function's CPU time at each pass
    queued_at_pass: tuple[int, ...]
    allocated_gpu_seconds: float


class _Event(IntEnum):
    """Ordered so that, at one instant, completions free capacity and arrivals join before the pass that plans."""

    COMPLETION = 0
    ARRIVAL = 1
    PASS = 2


class _Phase(IntEnum):
    PENDING = 0
    QUEUED = 1
    RUNNING = 2
    FINISHED = 3


@dataclass(slots=True, eq=False)
class _Job:
    trace: TraceJob
    index: int
    min_workers: int
    remaining: float  # seconds of work at the requested size
    phase: _Phase = _Phase.PENDING
    nodes: list[int] = field(default_factory=list)  # the node of each worker
    rate: float = 0.0
    paused_until: float = 0.0
    updated_at: float = 0.0
    attempt_started_at: float = 0.0
    attempt_running_s: float = 0.0
    last_resized_at: float | None = None
    attained_gpu_s: float = 0.0
    first_started_at: float | None = None
    queued_since: float = 0.0
    waited_s: float = 0.0
    finished_at: float = 0.0
    preemptions: int = 0
    shrinks: int = 0
    grows: int = 0
    lost_s: float = 0.0
    preempted_for: str | None = None
    resumes: bool = False  # it was preempted: its next start pays the restart
    version: int = 0  # bumped whenever its completion time moves; older completion events are stale
    queued_view: QueuedJob | None = None
    node_names: tuple[str, ...] | None = None  # its workers' node ids as the plan sees them, until they change


class Simulation:
    """One policy over one trace on one cluster. `run()` replays every job to its end."""

    def __init__(
        self,
        jobs: tuple[TraceJob, ...],
        cluster: ClusterShape,
        settings: SimulationSettings,
        policy: PolicyName,
        planner: Planner,
        progress: ProgressCallback | None = None,
    ) -> None:
        too_large = [job.job_id for job in jobs if job.gpus > cluster.gpus]
        if too_large:
            raise SimulationInputError(f"job {too_large[0]} asks for more than the cluster's {cluster.gpus} GPUs")
        self.cluster = cluster
        self.settings = settings
        self.policy = settings.policy(policy)
        self.planner = planner
        self.progress = progress
        self.model = settings.job_model
        self.jobs = [
            _Job(trace=job, index=index, min_workers=job.min_gpus or job.gpus, remaining=job.duration)
            for index, job in enumerate(jobs)
        ]
        self.by_id = {job.trace.job_id: job for job in self.jobs}
        self.node_ids = [f"node-{index:05d}" for index in range(cluster.nodes)]
        self.node_index = {node: index for index, node in enumerate(self.node_ids)}
        self.free_gpus = [cluster.gpus_per_node] * cluster.nodes
        self.queued: dict[int, _Job] = {}
        self.running: dict[int, _Job] = {}
        self.events: list[tuple[float, int, int, int, int]] = []
        self.sequence = 0
        self.now = 0.0
        self.last_pass_at = -math.inf
        self.next_pass_at: float | None = None
        self.pending_arrivals = len(self.jobs)
        self.finished = 0
        self.busy_gpus = 0
        self.accounted_at = min((job.submit_time for job in jobs), default=0.0)
        self.allocated_gpu_seconds = 0.0
        self.tenants = sorted({job.tenant for job in jobs})
        self.tenant_busy = dict.fromkeys(self.tenants, 0)
        self.tenant_gpu_seconds = dict.fromkeys(self.tenants, 0.0)
        self.tenant_views = tuple(TenantView(tenant, settings.weight(tenant)) for tenant in self.tenants)
        self.capacity = Held(gpus=float(cluster.gpus), cpus=cluster.cpus_per_node * cluster.nodes)
        self.shares = FairShareLedger(self.policy.fair_share_half_life_s, start=self.accounted_at)
        self.timeline: list[tuple[float, int, int]] = []
        self.decision_cpu_ms: list[float] = []
        self.queued_at_pass: list[int] = []

    def run(self) -> SimulationRun:
        for job in self.jobs:
            self._push(job.trace.submit_time, _Event.ARRIVAL, job.index, 0)
        while self.events:
            at, kind, _, index, version = heapq.heappop(self.events)
            if kind == _Event.PASS:
                if at == self.next_pass_at:
                    self._move_clock(at)
                    self._pass()
            elif kind == _Event.ARRIVAL:
                self._move_clock(at)
                self._arrive(self.jobs[index])
            elif version == self.jobs[index].version and self.jobs[index].phase is _Phase.RUNNING:
                self._move_clock(at)
                self._complete(self.jobs[index])
        return self._outcome()

    # The clock and the accounts

    def _move_clock(self, at: float) -> None:
        elapsed = at - self.accounted_at
        if elapsed > 0:
            self.allocated_gpu_seconds += self.busy_gpus * elapsed
            for tenant, busy in self.tenant_busy.items():
                self.tenant_gpu_seconds[tenant] += busy * elapsed
            self.accounted_at = at
        self.now = at

    def _record(self) -> None:
        """Note the cluster after a change: the timeline's point, and each tenant's holdings for fair share."""
        self.timeline.append((self.now, self.busy_gpus, len(self.queued)))
        holdings = {tenant: Held(gpus=float(busy)) for tenant, busy in self.tenant_busy.items() if busy}
        self.shares.record(self.now, holdings, self.capacity)

    def _push(self, at: float, kind: _Event, index: int, version: int) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (at, kind, self.sequence, index, version))

    def _request_pass(self, earliest: float) -> None:
        """A pass at `earliest`, or one interval after the last pass if that is later; keeps the sooner of two."""
        at = max(earliest, self.last_pass_at + self.settings.scheduling_interval_s)
        if self.next_pass_at is None or at < self.next_pass_at:
            self.next_pass_at = at
            self._push(at, _Event.PASS, -1, 0)

    # Events

    def _arrive(self, job: _Job) -> None:
        self.pending_arrivals -= 1
        job.phase = _Phase.QUEUED
        job.queued_since = self.now
        self.queued[job.index] = job
        self._record()
        self._request_pass(self.now)

    def _complete(self, job: _Job) -> None:
        self._advance(job)
        job.remaining = 0.0
        self._release(job, list(job.nodes))
        del self.running[job.index]
        job.phase = _Phase.FINISHED
        job.finished_at = self.now
        self.finished += 1
        self._record()
        if self.queued or self.running:
            self._request_pass(self.now)

    def _pass(self) -> None:
        self.next_pass_at = None
        self.last_pass_at = self.now
        snapshot = self._snapshot()
        started = time.process_time()
        plan = self.planner(snapshot)
        self.decision_cpu_ms.append((time.process_time() - started) * 1000.0)
        self.queued_at_pass.append(len(snapshot.queued))
        # Without running resizes a plan's grows of running jobs are not carried out: no action, no pass sooner.
        grew = bool(plan.grows) and bool(self.model.running_resizes)
        acted = bool(plan.admissions or plan.shrinks or grew or plan.preemptions)
        self._apply(plan)
        self._record()
        if self.progress is not None:
            self.progress(self.finished)
        if acted:
            self._request_pass(self.now)
        elif self.queued:
            if not self.running and not self.pending_arrivals:
                raise PlanViolation(
                    f"the {self.policy.name} plan starts none of {len(self.queued)} queued jobs on an "
                    f"idle cluster at t={self.now:.0f} s"
                )
            self._request_pass(self.now + self.settings.scheduling_interval_s)

    # What the plan sees

    def _snapshot(self) -> SchedulingInput:
        per_node = self.cluster.gpus_per_node
        cpus = self.cluster.cpus_per_node
        nodes = tuple(NodeView(node, per_node, cpus, free, cpus) for node, free in zip(self.node_ids, self.free_gpus))
        running = tuple(self._running_view(job) for job in self.running.values())
        queued = tuple(self._queued_view(job) for job in self.queued.values())
        tenants = self.shares.tenant_views(self.tenant_views, self.now)
        return SchedulingInput(self.now, nodes, running, queued, tenants, self.policy)

    def _running_view(self, job: _Job) -> RunningJob:
        trace = job.trace
        if job.node_names is None:
            job.node_names = tuple([self.node_ids[node] for node in job.nodes])
        return RunningJob(
            trace.job_id,
            trace.tenant,
            trace.priority,
            GPU_WORKER,
            job.node_names,
            job.min_workers if self.model.running_resizes else max(job.min_workers, len(job.nodes)),
            trace.gpus,
            trace.preemptible,
            job.attempt_started_at,
            job.last_resized_at,
            job.attained_gpu_s + len(job.nodes) * (self.now - job.updated_at),
            trace.submit_time,
        )

    def _queued_view(self, job: _Job) -> QueuedJob:
        if job.queued_view is None:
            trace = job.trace
            job.queued_view = QueuedJob(
                id=trace.job_id,
                tenant=trace.tenant,
                priority=trace.priority,
                shape=GPU_WORKER,
                min_workers=job.min_workers,
                max_workers=trace.gpus,
                preemptible=trace.preemptible,
                submitted_at=trace.submit_time,
                attained_gpu_seconds=job.attained_gpu_s,
                preempted_for=job.preempted_for,
            )
        return job.queued_view

    # Carrying out a plan: what it frees first, then what it takes

    def _apply(self, plan: Plan) -> None:
        waits_for: dict[str, float] = {}  # an admitted job waits for the shrinks and preemptions made for it
        for preemption in plan.preemptions:
            self._preempt(self._job(preemption.job_id, _Phase.RUNNING, "preempt"), preemption.for_job)
            if preemption.for_job is not None:
                waits_for[preemption.for_job] = max(waits_for.get(preemption.for_job, 0.0), self.model.preemption_s)
        for shrink in plan.shrinks:
            job = self._job(shrink.job_id, _Phase.RUNNING, "shrink")
            self._resize(job, shrink.workers, shrink.nodes, growing=False)
            if shrink.for_job is not None:
                waits_for[shrink.for_job] = max(waits_for.get(shrink.for_job, 0.0), self.model.shrink_s)
        admitted = {admission.job_id for admission in plan.admissions}
        # A job admitted and grown in the same pass starts at the grown size: one start, no resize.
        grown_at_start = {grow.job_id: grow for grow in plan.grows if grow.job_id in admitted}
        for admission in plan.admissions:
            job = self._job(admission.job_id, _Phase.QUEUED, "admit")
            grow_at_start = grown_at_start.get(admission.job_id)
            workers, nodes = admission.workers, admission.nodes
            if grow_at_start is not None:
                workers, nodes = grow_at_start.workers, nodes + grow_at_start.nodes
            self._start(job, workers, nodes, waits_for.get(job.trace.job_id, 0.0))
        for grow in plan.grows:
            if grow.job_id not in grown_at_start and self.model.running_resizes:
                job = self._job(grow.job_id, _Phase.RUNNING, "grow")
                self._resize(job, grow.workers, grow.nodes, growing=True)

    def _job(self, job_id: str, phase: _Phase, action: str) -> _Job:
        job = self.by_id.get(job_id)
        if job is None or job.phase is not phase:
            state = "unknown" if job is None else job.phase.name.lower()
            raise PlanViolation(f"the plan asked to {action} job {job_id}, which is {state}, at t={self.now:.0f} s")
        return job

    def _start(self, job: _Job, workers: int, nodes: tuple[str, ...], waits_s: float) -> None:
        if len(nodes) != workers or not job.min_workers <= workers <= job.trace.gpus:
            raise PlanViolation(
                f"the plan admitted job {job.trace.job_id} at {workers} workers on {len(nodes)} nodes; it runs at "
                f"{job.min_workers}–{job.trace.gpus}"
            )
        del self.queued[job.index]
        job.waited_s += self.now - job.queued_since
        job.queued_view = None
        job.phase = _Phase.RUNNING
        self.running[job.index] = job
        job.updated_at = self.now
        job.attempt_started_at = self.now
        job.attempt_running_s = 0.0
        if job.first_started_at is None:
            job.first_started_at = self.now
        job.paused_until = self.now + waits_s + (self.model.restart_s if job.resumes else 0.0)
        job.resumes = False
        self._take(job, nodes)
        self._reschedule(job)

    def _resize(self, job: _Job, workers: int, nodes: tuple[str, ...], growing: bool) -> None:
        change = len(nodes) if growing else -len(nodes)
        if not nodes or len(job.nodes) + change != workers or not job.min_workers <= workers <= job.trace.gpus:
            verb = "grow" if growing else "shrink"
            raise PlanViolation(
                f"the plan asked to {verb} job {job.trace.job_id} from {len(job.nodes)} to {workers} workers by "
                f"{len(nodes)}; it runs at {job.min_workers}–{job.trace.gpus}"
            )
        self._advance(job)
        if growing:
            self._take(job, nodes)
            job.grows += 1
        else:
            self._release(job, [self._node(node) for node in nodes])
            job.shrinks += 1
        job.last_resized_at = self.now
        pause = self.model.grow_s if growing else self.model.shrink_s
        job.paused_until = max(job.paused_until, self.now) + pause
        self._reschedule(job)

    def _preempt(self, job: _Job, for_job: str | None) -> None:
        self._advance(job)
        lost_s = self.model.lost_on_preemption(job.trace.elastic, job.attempt_running_s)
        job.remaining += lost_s * job.rate
        job.lost_s += lost_s
        job.preemptions += 1
        job.preempted_for = for_job
        job.resumes = True
        job.version += 1
        self._release(job, list(job.nodes))
        del self.running[job.index]
        job.phase = _Phase.QUEUED
        job.queued_since = self.now
        job.queued_view = None
        self.queued[job.index] = job

    def _advance(self, job: _Job) -> None:
        """Bring a running job's remaining work and attained service up to now."""
        productive_from = max(job.updated_at, job.paused_until)
        if self.now > productive_from:
            ran = self.now - productive_from
            job.remaining = max(0.0, job.remaining - ran * job.rate)
            job.attempt_running_s += ran
        job.attained_gpu_s += len(job.nodes) * (self.now - job.updated_at)
        job.updated_at = self.now

    def _reschedule(self, job: _Job) -> None:
        job.rate = self.model.rate(len(job.nodes), job.trace.gpus)
        job.version += 1
        finish = max(self.now, job.paused_until) + job.remaining / job.rate
        self._push(finish, _Event.COMPLETION, job.index, job.version)

    def _node(self, node: str) -> int:
        index = self.node_index.get(node)
        if index is None:
            raise PlanViolation(f"the plan named node {node!r}, which the cluster does not have")
        return index

    def _take(self, job: _Job, nodes: tuple[str, ...]) -> None:
        for node in nodes:
            index = self._node(node)
            if self.free_gpus[index] < 1:
                raise PlanViolation(
                    f"the plan placed a worker of job {job.trace.job_id} on node {node}, which has no free GPU, "
                    f"at t={self.now:.0f} s"
                )
            self.free_gpus[index] -= 1
            job.nodes.append(index)
        job.node_names = None
        self.busy_gpus += len(nodes)
        self.tenant_busy[job.trace.tenant] += len(nodes)

    def _release(self, job: _Job, nodes: list[int]) -> None:
        for index in nodes:
            try:
                job.nodes.remove(index)
            except ValueError:
                raise PlanViolation(
                    f"the plan took a worker of job {job.trace.job_id} off node {self.node_ids[index]}, where it "
                    "has none"
                ) from None
            self.free_gpus[index] += 1
        job.node_names = None
        self.busy_gpus -= len(nodes)
        self.tenant_busy[job.trace.tenant] -= len(nodes)

    def _outcome(self) -> SimulationRun:
        outcomes = tuple(
            JobOutcome(
                job_id=job.trace.job_id,
                tenant=job.trace.tenant,
                gpus=job.trace.gpus,
                duration=job.trace.duration,
                submitted_at=job.trace.submit_time,
                first_started_at=job.first_started_at if job.first_started_at is not None else math.nan,
                finished_at=job.finished_at,
                waited_s=job.waited_s,
                preemptions=job.preemptions,
                shrinks=job.shrinks,
                grows=job.grows,
                lost_s=job.lost_s,
            )
            for job in self.jobs
        )
        return SimulationRun(
            policy=self.policy.name,
            cluster=self.cluster,
            jobs=outcomes,
            timeline=tuple(self.timeline),
            tenant_gpu_seconds=dict(self.tenant_gpu_seconds),
            tenant_weights={tenant: self.settings.weight(tenant) for tenant in self.tenants},
            decision_cpu_ms=tuple(self.decision_cpu_ms),
            queued_at_pass=tuple(self.queued_at_pass),
            allocated_gpu_seconds=self.allocated_gpu_seconds,
        )
