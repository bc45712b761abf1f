"""The live side of a scheduling pass: the job table and one read of the cluster in, the plan's decisions out.

The plan itself (service/scheduling/plan.py) is pure; this module builds its input from what the dispatcher reads and
writes back what a person sees of it: each queued job's place in the plan and why it waits. `ringmaster simulate`
builds the same input from a simulated cluster instead.

A running job's size is its placement group's bundle count, on the nodes Ray placed them. A job asked to save and
stop for a preemption is leaving: its capacity counts as free already (so the plan does not preempt a second job for
the same room), and the job it makes room for is admitted once Ray has that room, in a later pass if need be.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from ringmaster.service.models import Attempt, Job, Tenant
from ringmaster.service.queue_view import ShareSample
from ringmaster.service.ray_cluster import ClusterView
from ringmaster.service.scheduling.fair_share import FairShareLedger, Held, dominant_share, held_by_tenant
from ringmaster.service.scheduling.model import (
    NodeView,
    Plan,
    PolicySettings,
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

    def __init__(self) -> None:
        self._queued: dict[str, tuple[int, QueuedJob]] = {}  # id -> (attempt, the job as planned)
        self._active: dict[str, tuple[int, ActiveAttempt]] = {}
        self.stored: dict[str, tuple[int | None, str | None]] = {}  # id -> (place, reason) in the table
        self._places_reread_at = float("-inf")  # the first pass reads them

    def read(self, session: Session, now: float) -> JobsRead:
        queued_keys = dict(session.execute(select(Job.id, Job.attempt).where(Job.state == JobState.QUEUED)).all())
        active_rows = session.execute(
            select(Job.id, Job.attempt, Job.preempt_requested_at).where(Job.state.in_([s.value for s in ACTIVE]))
        ).all()
        active_keys = {job_id: attempt for job_id, attempt, _ in active_rows}
        self._forget(self._queued, queued_keys)
        self._forget(self._active, active_keys)
        for job_id in set(self.stored) - queued_keys.keys():
            del self.stored[job_id]
        self._read_queued(session, [job_id for job_id in queued_keys if job_id not in self._queued])
        self._read_active(session, [job_id for job_id in active_keys if job_id not in self._active], now)
        if now - self._places_reread_at >= self._STORED_PLACES_REREAD_S:
            self._places_reread_at = now
            stored = select(Job.id, Job.queue_position, Job.waiting_reason).where(Job.state == JobState.QUEUED)
            self.stored = {job_id: (place, reason) for job_id, place, reason in session.execute(stored)}
        tenants = tuple(
            TenantView(
                name=tenant.name,
                weight=tenant.weight,
                quota_gpus=tenant.quota_gpus,
                quota_cpus=tenant.quota_cpus,
                quota_jobs=tenant.quota_jobs,
            )
            for tenant in session.scalars(select(Tenant))
        )
        known_queued, known_active = self._queued, self._active
        return JobsRead(
            queued=tuple(known_queued[job_id][1] for job_id in queued_keys if job_id in known_queued),
            active=tuple(
                (known_active[job_id][1], requested is not None)
                for job_id, _, requested in active_rows
                if job_id in known_active
            ),
            tenants=tenants,
            new_in_queue=any(self.stored.get(job_id, (None, None))[0] is None for job_id in queued_keys),
        )

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

    def recorded(self, changed: list[dict[str, Any]]) -> None:
        for row in changed:
            self.stored[row["id"]] = (row["queue_position"], row["waiting_reason"])

    def written_elsewhere(self, job_id: str) -> None:
        """The job's place or reason was written outside record_queue: the next record writes the plan's again."""
        self.stored.pop(job_id, None)


def pass_input(
    jobs: JobsRead,
    view: ClusterView,
    policy: PolicySettings,
    ledger: FairShareLedger,
    now: float,
    *,
    resizable: bool,
) -> SchedulingInput:
    """The plan's input. `resizable`: whether running jobs may be shrunk by a plan (else each counts as at its
    workers.min, so the plan only preempts it whole)."""
    free: dict[str, list[float]] = {node["id"]: [node["free_GPU"], node["free_CPU"]] for node in view["nodes"]}
    groups = view["groups"]
    running: list[RunningJob] = []
    for attempt, leaving in jobs.active:
        nodes = tuple(node for node in groups.get(attempt.placement_group or "", ()) if node is not None)
        if leaving:
            shape = attempt.shape
            for node in nodes:  # its room is as good as free
                if node in free:
                    free[node][0 if shape.gpus else 1] += shape.gpus or shape.cpus
        elif nodes:
            running.append(_running(attempt, nodes, resizable))
    node_views = tuple(
        NodeView(
            id=node["id"],
            total_gpus=int(node["GPU"]),
            total_cpus=float(node["CPU"]),
            free_gpus=int(free[node["id"]][0]),
            free_cpus=free[node["id"]][1],
        )
        for node in view["nodes"]
    )
    capacity = Held(float(sum(node.total_gpus for node in node_views)), sum(node.total_cpus for node in node_views))
    ledger.record(now, held_by_tenant(running), capacity)
    return SchedulingInput(
        now=now,
        nodes=node_views,
        running=tuple(running),
        queued=jobs.queued,
        tenants=ledger.tenant_views(list(jobs.tenants), now),
        policy=policy,
    )


def _running(attempt: ActiveAttempt, nodes: tuple[str, ...], resizable: bool) -> RunningJob:
    return RunningJob(
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

    def add(shape: WorkerShape, count: int) -> None:
        bundle = {"GPU": float(shape.gpus)} if shape.gpus > 0 else {"CPU": float(shape.cpus)}
        bundles.extend(dict(bundle) for _ in range(min(count, limit - len(bundles))))

    for job in state.running:
        add(job.shape, job.workers)
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
