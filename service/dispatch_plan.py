"""The live side of a scheduling pass: the job table and one read of the cluster in, the plan's decisions out.

The plan itself (service/scheduling/plan.py) is pure; this module builds its input from what the dispatcher reads and
writes back what a person sees of it: each queued job's place in the plan and why it waits. `ringmaster simulate`
builds the same input from a simulated cluster instead.

A running job's size is its placement group's bundle count, on the nodes Ray placed them. A job asked to save and
stop for a preemption is leaving: its capacity counts as free already (so the plan does not preempt a second job for
the same room), and the job it makes room for is admitted once Ray has that room, in a later pass if need be.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from itertools import repeat
from operator import itemgetter
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from ringmaster.service.models import Attempt, Job, Tenant
from ringmaster.service.queue_view import ShareSample
from ringmaster.service.ray_cluster import ClusterView, NodeResources
from ringmaster.service.scheduling.fair_share import FairShareLedger, Held, dominant_share, held_by_tenant
from ringmaster.service.scheduling.model import (
    NodeView,
    Plan,
    PolicySettings,
    Preemption,
    QueuedJob,
    RunningJob,
    SchedulingInput,
    TenantView,
    WorkerShape,
)
from ringmaster.service.settings import Settings
from ringmaster.service.states import ACTIVE, JobState


def policy_settings(settings: Settings) -> PolicySettings:
    return PolicySettings(
        name=settings.scheduling_policy,
        min_run_s=settings.min_run_before_preemption_s,
        min_resize_interval_s=settings.min_resize_interval_s,
        fair_share_half_life_s=settings.fair_share_half_life_s,
        reserve_after_s=settings.reserve_after_s,
        hold_after_s=settings.hold_after_s,
        fair_share_preemption_above=settings.fair_share_preemption_above,
    )


@dataclass(frozen=True)
class ActiveAttempt:
    """What a pass needs of an active job's current attempt, none of which changes during the attempt."""

    id: str
    tenant: str
    priority: int
    shape: WorkerShape
    min_workers: int
    max_workers: int  # its spec's, capped by what its tenant's quota granted at admission
    preemptible: bool
    submitted_at: float
    placement_group: str | None
    started_at: float


@dataclass(frozen=True)
class JobsRead:
    """One pass's read of the job table: the queued jobs as the plan takes them, each active attempt with whether it
    is leaving (asked to save and stop for a preemption), and the tenants."""

    queued: tuple[QueuedJob, ...]
    active: tuple[tuple[ActiveAttempt, bool], ...]
    tenants: tuple[TenantView, ...]
    new_in_queue: bool  # a queued job the queue was not recorded for yet (its first place and reason come at once)


def _seconds(moment: datetime | None, default: float) -> float:
    return moment.timestamp() if moment is not None else default


def _worker_shape(spec: dict[str, Any]) -> tuple[WorkerShape, int, int]:
    """A stored spec's worker shape, workers.min and workers.max, read without validating the whole spec again (it
    was validated at submit)."""
    workers = spec.get("workers") or {}
    shape = WorkerShape(gpus=int(workers.get("gpus_per_worker", 0)), cpus=float(workers.get("cpus_per_worker", 1.0)))
    low = int(workers.get("min", 1))
    return shape, low, max(low, int(workers.get("max", low)))


# What a pass reads of a job new to it, queued or active (then with its current attempt's columns too).
_JOB_COLUMNS = (Job.id, Job.attempt, Job.tenant, Job.priority, Job.spec, Job.created_at)
# What every pass reads of every queued and active job, from ix_jobs_dispatch alone.
_QUEUED_KEYS = select(Job.id, Job.attempt).where(Job.state == JobState.QUEUED)
_TENANT_COLUMNS = select(Tenant.name, Tenant.weight, Tenant.quota_gpus, Tenant.quota_cpus, Tenant.quota_jobs)
_ACTIVE_KEYS = select(Job.id, Job.attempt, Job.preempt_requested_at.is_not(None).label("leaving")).where(
    Job.state.in_([s.value for s in ACTIVE])
)
_UNRECORDED = (None, None)


class KnownJobs:
    """The dispatcher's memory of the job table between passes, so that a pass over 10,000 queued jobs reads two
    narrow columns of each (its id and attempt number) rather than every row and its JSON spec.

    What the plan needs of a queued job (its tenant, priority, shape and the job it made way for) and of an active
    job's attempt (its placement group, start and grant) does not change while the job keeps its attempt number: a
    job's spec, tenant and priority never change after submit, preempted_for is set only while a job runs, and an
    attempt's row is written once, at admission. So a job is read in full only when its (id, attempt) is new to this
    memory, and forgotten when it is neither queued nor active. Whether a running job is leaving is read every pass.

    Each waiting job's place and reason as stored: read with the job, then kept as this dispatcher writes them, and
    read again in full every _STORED_PLACES_REREAD_S (another dispatcher replica writes them too)."""

    _READ_AT_ONCE = 900  # ids in one IN (...) (SQLite's bound-variable limit is 32,766; PostgreSQL's 65,535)
    _STORED_PLACES_REREAD_S = 60.0
    _SETTLE_AFTER = 1000  # jobs read in full since the last freeze (settle)

    def __init__(self) -> None:
        self._queued: dict[str, tuple[int, QueuedJob]] = {}  # id -> (attempt, the job as planned)
        self._active: dict[str, tuple[int, ActiveAttempt]] = {}
        self.stored: dict[str, tuple[int | None, str | None]] = {}  # id -> (place, reason) in the table
        self._places_reread_at = float("-inf")  # the first pass reads them
        self._unsettled = 0
        # What _queued and _active hold, as each pass reads it (id -> attempt), and the queued jobs as the plan takes
        # them: while a pass reads the same, nothing is read again or rebuilt.
        self._queued_attempts: dict[str, int] = {}
        self._active_attempts: dict[str, int] = {}
        self._queued_jobs: tuple[QueuedJob, ...] = ()
        # The plan's input objects kept between passes, each rebuilt only when what it is built from changes.
        self._running: dict[str, tuple[ActiveAttempt, list[str | None], bool, RunningJob]] = {}
        self._nodes: dict[str, tuple[tuple[float, float, float, float, float | None], NodeView]] = {}
        self._held: tuple[list[RunningJob], dict[str, Held]] = ([], {})

    def read(self, session: Session, now: float) -> JobsRead:
        # Core rows, not ORM ones (a third of the time), each read from ix_jobs_dispatch alone (migration 0013).
        connection = session.connection()
        queued_keys: dict[str, int] = dict(connection.execute(_QUEUED_KEYS).all())
        active_rows = connection.execute(_ACTIVE_KEYS).all()
        active_keys = {job_id: attempt for job_id, attempt, _ in active_rows}
        read = 0
        if queued_keys != self._queued_attempts:  # else (most passes) nothing joined or left the queue
            self._forget(self._queued, queued_keys)
            for job_id in self.stored.keys() - queued_keys.keys():
                del self.stored[job_id]
            new = [job_id for job_id in queued_keys if job_id not in self._queued]
            self._read_queued(session, new)
            read += len(new)
            self._queued_attempts = {job_id: attempt for job_id, (attempt, _) in self._queued.items()}
            self._queued_jobs = tuple([job for _, job in self._queued.values()])
        if active_keys != self._active_attempts:
            self._forget(self._active, active_keys)
            new = [job_id for job_id in active_keys if job_id not in self._active]
            self._read_active(session, new, now)
            read += len(new)
            self._active_attempts = {job_id: attempt for job_id, (attempt, _) in self._active.items()}
        self._unsettled += read
        if now - self._places_reread_at >= self._STORED_PLACES_REREAD_S:
            self._places_reread_at = now
            stored = select(Job.id, Job.queue_position, Job.waiting_reason).where(Job.state == JobState.QUEUED)
            self.stored = {job_id: (place, reason) for job_id, place, reason in connection.execute(stored)}
        tenants = tuple(
            TenantView(name=name, weight=weight, quota_gpus=gpus, quota_cpus=cpus, quota_jobs=count)
            for name, weight, gpus, cpus, count in connection.execute(_TENANT_COLUMNS)
        )
        known_active = self._active
        # Whether a queued job has no stored place (none, or not recorded yet): the stored place of each, in C.
        places = map(itemgetter(0), map(self.stored.get, queued_keys, repeat(_UNRECORDED)))
        return JobsRead(
            queued=self._queued_jobs,
            active=tuple(
                [(known_active[job_id][1], leaving) for job_id, _, leaving in active_rows if job_id in known_active]
            ),
            tenants=tenants,
            new_in_queue=None in places,
        )

    def settle(self) -> None:
        """Once many jobs were read at once (the first pass, a large batch of submits), and the plan's input built
        from them: collect the garbage and freeze what is left. The jobs this memory keeps, their input objects (and
        the process's other long-lived objects) are then never rescanned by the garbage collector's oldest
        generation, which with 10,000 queued jobs paused a pass for ~55 ms every other pass. Frozen objects are still
        freed once no longer referenced; only a reference cycle among them would outlive them."""
        if self._unsettled >= self._SETTLE_AFTER:
            self._unsettled = 0
            gc.collect()
            gc.freeze()

    @staticmethod
    def _forget(known: dict[str, tuple[int, Any]], current: dict[str, int]) -> None:
        """Drop what is no longer queued (or active), or is at another attempt now."""
        for job_id in [job_id for job_id, (attempt, _) in known.items() if current.get(job_id) != attempt]:
            del known[job_id]

    def _chunks(self, ids: list[str]) -> Iterable[list[str]]:
        return (ids[start : start + self._READ_AT_ONCE] for start in range(0, len(ids), self._READ_AT_ONCE))

    def _read_queued(self, session: Session, ids: list[str]) -> None:
        for chunk in self._chunks(ids):
            rows = session.execute(
                select(*_JOB_COLUMNS, Job.preempted_for, Job.queue_position, Job.waiting_reason).where(
                    Job.id.in_(chunk), Job.state == JobState.QUEUED
                )
            )
            for row in rows:
                shape, low, high = _worker_shape(row.spec)
                job = QueuedJob(
                    id=row.id,
                    tenant=row.tenant,
                    priority=row.priority,
                    shape=shape,
                    min_workers=low,
                    max_workers=high,
                    preemptible=bool(row.spec.get("preemptible", True)),
                    submitted_at=_seconds(row.created_at, 0.0),
                    preempted_for=row.preempted_for,
                )
                self._queued[row.id] = (row.attempt, job)
                self.stored[row.id] = (row.queue_position, row.waiting_reason)

    def _read_active(self, session: Session, ids: list[str], now: float) -> None:
        current_attempt = (Attempt.job_id == Job.id) & (Attempt.number == Job.attempt)
        for chunk in self._chunks(ids):
            rows = session.execute(
                select(
                    *_JOB_COLUMNS,
                    Attempt.placement_group,
                    Attempt.started_at,
                    Attempt.max_workers,
                )
                .join(Attempt, current_attempt)
                .where(Job.id.in_(chunk))
            )
            for row in rows:
                shape, low, high = _worker_shape(row.spec)
                attempt = ActiveAttempt(
                    id=row.id,
                    tenant=row.tenant,
                    priority=row.priority,
                    shape=shape,
                    min_workers=low,
                    max_workers=high if row.max_workers is None else min(high, row.max_workers),
                    preemptible=bool(row.spec.get("preemptible", True)),
                    submitted_at=_seconds(row.created_at, now),
                    placement_group=row.placement_group,
                    started_at=_seconds(row.started_at, now),
                )
                self._active[row.id] = (row.attempt, attempt)

    def running_job(self, attempt: ActiveAttempt, placed: list[str | None], resizable: bool) -> RunningJob:
        """The running job as the plan takes it: last pass's, while its attempt and the nodes of its bundles are
        the same."""
        kept = self._running.get(attempt.id)
        if kept is not None and kept[0] is attempt and kept[2] == resizable and kept[1] == placed:
            return kept[3]
        nodes = tuple(node for node in placed if node is not None)
        job = RunningJob(
            id=attempt.id,
            tenant=attempt.tenant,
            priority=attempt.priority,
            shape=attempt.shape,
            nodes=nodes,
            min_workers=attempt.min_workers if resizable else max(attempt.min_workers, len(nodes)),
            max_workers=max(attempt.max_workers, len(nodes)),
            preemptible=attempt.preemptible,
            started_at=attempt.started_at,
            submitted_at=attempt.submitted_at,
        )
        self._running[attempt.id] = (attempt, list(placed), resizable, job)
        return job

    def node_view(self, node: NodeResources, free: list[float]) -> NodeView:
        """The node as the plan takes it: last pass's, while its totals and what is free are the same."""
        drain_deadline = drain_deadline_of(node)
        amounts = (node["GPU"], node["CPU"], free[0], free[1], drain_deadline)
        kept = self._nodes.get(node["id"])
        if kept is not None and kept[0] == amounts:
            return kept[1]
        made = NodeView(
            id=node["id"],
            total_gpus=int(node["GPU"]),
            total_cpus=float(node["CPU"]),
            free_gpus=int(free[0]),
            free_cpus=free[1],
            drain_deadline=drain_deadline,
        )
        self._nodes[node["id"]] = (amounts, made)
        return made

    def held_by_tenant(self, running: list[RunningJob]) -> dict[str, Held]:
        """What each tenant holds: last pass's, while its running jobs are the same objects."""
        if running != self._held[0]:  # compared job by job, each by identity first
            self._held = (running, held_by_tenant(running))
        return self._held[1]

    def forget_inputs(self, running: list[RunningJob], nodes: tuple[NodeView, ...]) -> None:
        """Keep only the input objects this pass used."""
        if len(self._running) > len(running):
            used = {job.id for job in running}
            self._running = {job_id: kept for job_id, kept in self._running.items() if job_id in used}
        if len(self._nodes) > len(nodes):
            ids = {node.id for node in nodes}
            self._nodes = {node_id: kept for node_id, kept in self._nodes.items() if node_id in ids}

    def recorded(self, changed: list[dict[str, Any]]) -> None:
        for row in changed:
            self.stored[row["id"]] = (row["queue_position"], row["waiting_reason"])

    def written_elsewhere(self, job_id: str) -> None:
        """The job's place or reason was written outside record_queue: the next record writes the plan's again."""
        self.stored.pop(job_id, None)


def drain_reason(state: SchedulingInput, preemption: Preemption, now: float) -> str | None:
    """What a preemption off a draining node says (None for one made for a job): the node and its deadline."""
    if preemption.for_job is not None:
        return None
    deadlines = {node.id: node.drain_deadline for node in state.nodes if node.drain_deadline is not None}
    job = next((job for job in state.running if job.id == preemption.job_id), None)
    on = sorted({node for node in job.nodes if node in deadlines}) if job is not None else []
    if not on:
        return "its node is going away"
    deadline = min(deadlines[node] for node in on)
    by = f", which goes in {max(0.0, deadline - now):.0f} s" if math.isfinite(deadline) else ""
    return f"its node {', '.join(node[:12] for node in on)} is draining{by}; it moves off it"


def drain_deadline_of(node: NodeResources) -> float | None:
    """The plan's drain deadline of a node: None while it does not drain, infinity for a drain without one."""
    if not node.get("draining"):
        return None
    deadline = node.get("drain_deadline")
    return math.inf if deadline is None else deadline


def pass_input(
    jobs: JobsRead,
    view: ClusterView,
    policy: PolicySettings,
    ledger: FairShareLedger,
    now: float,
    *,
    resizable: bool,
    known: KnownJobs | None = None,
) -> SchedulingInput:
    """The plan's input. `resizable`: whether running jobs may be shrunk by a plan (else each counts as at its
    workers.min, so the plan only preempts it whole). `known`: the dispatcher's memory, whose input objects of the
    last pass are taken again where nothing they are built from changed."""
    inputs = known if known is not None else KnownJobs()
    free: dict[str, list[float]] = {node["id"]: [node["free_GPU"], node["free_CPU"]] for node in view["nodes"]}
    groups = view["groups"]
    running: list[RunningJob] = []
    for attempt, leaving in jobs.active:
        placed = groups.get(attempt.placement_group or "") or []
        if leaving:
            shape = attempt.shape
            for node in placed:  # its room is as good as free
                if node is not None and node in free:
                    free[node][0 if shape.gpus else 1] += shape.gpus or shape.cpus
        elif placed.count(None) < len(placed):
            running.append(inputs.running_job(attempt, placed, resizable))
    node_views = tuple([inputs.node_view(node, free[node["id"]]) for node in view["nodes"]])
    inputs.forget_inputs(running, node_views)
    inputs.settle()
    capacity = Held(float(sum(node.total_gpus for node in node_views)), sum(node.total_cpus for node in node_views))
    ledger.record(now, inputs.held_by_tenant(running), capacity)
    return SchedulingInput(
        now=now,
        nodes=node_views,
        running=tuple(running),
        queued=jobs.queued,
        tenants=ledger.tenant_views(list(jobs.tenants), now),
        policy=policy,
    )


def admission_sizes(decided: Plan) -> dict[str, int]:
    """The size each admitted job starts at: its admission, grown in the same plan where the plan grew it."""
    sizes = {admission.job_id: admission.workers for admission in decided.admissions}
    for grow in decided.grows:
        if grow.job_id in sizes:
            sizes[grow.job_id] = grow.workers
    return sizes


def record_queue(session: Session, decided: Plan, known: KnownJobs) -> int:
    """Write each waiting job's place (1: the next to start; jobs this plan admits are not counted) and why it waits,
    where either differs from what is stored, in one batched statement; returns how many rows changed. Every admission
    moves each job behind it up one place, so a long queue changes most rows at once: the dispatcher records the
    queue only every few seconds (_QUEUE_RECORD_INTERVAL_S)."""
    waiting = [position for position in decided.queue if position.reason]
    stored = known.stored
    changed = [
        {"id": position.job_id, "queue_position": place, "waiting_reason": position.reason}
        for place, position in enumerate(waiting, start=1)
        if stored.get(position.job_id) != (place, position.reason)
    ]
    if changed:
        session.execute(update(Job), changed)  # an UPDATE by primary key, executed for all rows at once
        known.recorded(changed)
    return len(changed)


def share_samples(state: SchedulingInput) -> list[ShareSample]:
    """Each tenant's standing in this pass, as the queue view's series records it: what its jobs hold, its dominant
    share now, its decayed share, and what its weight entitles it to among the tenants with work (running or queued;
    a tenant without work is entitled to nothing, and shown only while its decayed share lasts)."""
    capacity = Held(float(sum(node.total_gpus for node in state.nodes)), sum(node.total_cpus for node in state.nodes))
    held = held_by_tenant(state.running)
    with_work = set(held) | {job.tenant for job in state.queued}
    views = {tenant.name: tenant for tenant in state.tenants}
    weights = {name: views[name].weight if name in views else 1.0 for name in with_work}
    total_weight = sum(weights.values())
    return [
        ShareSample(
            tenant=name,
            held_gpus=int(held.get(name, Held()).gpus),
            held_cpus=held.get(name, Held()).cpus,
            share=dominant_share(held.get(name, Held()), capacity),
            decayed_share=views[name].decayed_share if name in views else 0.0,
            entitled_share=weights[name] / total_weight if total_weight > 0 else 0.0,
        )
        for name in sorted(with_work | {name for name, view in views.items() if view.decayed_share > 0})
    ]


def autoscaler_request(state: SchedulingInput, decided: Plan, limit: int) -> list[dict[str, float]]:
    """The shapes Ray's autoscaler should make room for at once: every running job's workers, then the workers.min of
    each queued job in plan order that its tenant's quota admits (what a node added would let start), at most `limit`
    bundles. Ray's autoscaler packs these onto the nodes there are and adds nodes for what does not fit."""
    bundles: list[dict[str, float]] = []
    # One bundle per shape, listed once per worker (nothing changes them).
    of_shape: dict[tuple[int, float], dict[str, float]] = {}

    def add(shape: WorkerShape, count: int) -> None:
        bundle = of_shape.get((shape.gpus, shape.cpus))
        if bundle is None:
            bundle = {"GPU": float(shape.gpus)} if shape.gpus > 0 else {"CPU": float(shape.cpus)}
            of_shape[shape.gpus, shape.cpus] = bundle
        bundles.extend([bundle] * max(0, min(count, limit - len(bundles))))

    for job in state.running:
        if len(bundles) >= limit:
            return bundles
        add(job.shape, len(job.nodes))
    queued = {job.id: job for job in state.queued}
    admitted = admission_sizes(decided)
    for position in decided.queue:
        if len(bundles) >= limit:
            break
        waiting = queued[position.job_id]
        if waiting.id in admitted:
            add(waiting.shape, admitted[waiting.id])
        elif not position.reason.startswith("over quota"):
            add(waiting.shape, waiting.min_workers)
    return bundles
