"""The live side of a scheduling pass: the job table and one read of the cluster in, the plan's decisions out.

The plan itself (service/scheduling/plan.py) is pure; this module builds its input from what the dispatcher reads and
writes back what a person sees of it: each queued job's place in the plan and why it waits. `ringmaster simulate`
builds the same input from a simulated cluster instead.

A running job's size is its placement group's bundle count, on the nodes Ray placed them. A job asked to save and
stop for a preemption is leaving: its capacity counts as free already (so the plan does not preempt a second job for
the same room), and the job it makes room for is admitted once Ray has that room, in a later pass if need be.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Row, select, update
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


@dataclass(frozen=True)
class LiveJob:
    """A running job as the dispatcher knows it beside its RunningJob: the placement group its attempt holds."""

    running: RunningJob
    placement_group: str | None
    leaving: bool  # asked to save and stop for a preemption


@dataclass(frozen=True)
class PassInput:
    state: SchedulingInput
    live: dict[str, LiveJob]
    queued_rows: dict[str, tuple[int | None, str | None]]  # job id -> (position, reason) as stored now

    def placement_groups(self) -> list[str]:
        return [job.placement_group for job in self.live.values() if job.placement_group]


def policy_settings(settings: Settings) -> PolicySettings:
    return PolicySettings(
        name=settings.scheduling_policy,
        min_run_s=settings.min_run_before_preemption_s,
        min_resize_interval_s=settings.min_resize_interval_s,
        fair_share_half_life_s=settings.fair_share_half_life_s,
    )


def _shape(spec: dict[str, Any]) -> tuple[WorkerShape, int, int]:
    """A stored spec's worker shape, workers.min and workers.max, read without validating the whole spec again (it
    was validated at submit): a pass over 10,000 queued jobs reads only these."""
    workers = spec.get("workers") or {}
    shape = WorkerShape(gpus=int(workers.get("gpus_per_worker", 0)), cpus=float(workers.get("cpus_per_worker", 1.0)))
    low = int(workers.get("min", 1))
    return shape, low, max(low, int(workers.get("max", low)))


def _seconds(moment: datetime | None, default: float) -> float:
    return moment.timestamp() if moment is not None else default


def read_jobs(session: Session) -> tuple[Sequence[Row[Any]], Sequence[Row[Any]], list[Tenant]]:
    """The queued jobs, the active jobs with their current attempt, and the tenants: what a pass reads of the
    database, in three queries."""
    queued = session.execute(
        select(
            Job.id,
            Job.tenant,
            Job.priority,
            Job.created_at,
            Job.spec,
            Job.preempted_for,
            Job.queue_position,
            Job.waiting_reason,
        ).where(Job.state == JobState.QUEUED)
    ).all()
    current_attempt = (Attempt.job_id == Job.id) & (Attempt.number == Job.attempt)
    active = session.execute(
        select(
            Job.id,
            Job.tenant,
            Job.priority,
            Job.created_at,
            Job.spec,
            Job.preempt_requested_at,
            Attempt.placement_group,
            Attempt.started_at,
            Attempt.max_workers,
        )
        .join(Attempt, current_attempt)
        .where(Job.state.in_([state.value for state in ACTIVE]))
    ).all()
    return queued, active, list(session.scalars(select(Tenant)))


def pass_input(
    queued: Iterable[Row[Any]],
    active: Iterable[Row[Any]],
    tenants: Iterable[Tenant],
    view: ClusterView,
    policy: PolicySettings,
    ledger: FairShareLedger,
    now: float,
    *,
    resizable: bool,
) -> PassInput:
    """The plan's input. `resizable`: whether running jobs may be shrunk by a plan (else each counts as at its
    workers.min, so the plan only preempts it whole)."""
    free: dict[str, list[float]] = {node["id"]: [node["free_GPU"], node["free_CPU"]] for node in view["nodes"]}
    live: dict[str, LiveJob] = {}
    for row in active:
        shape, low, high = _shape(row.spec)
        nodes = tuple(node for node in view["groups"].get(row.placement_group or "", []) if node is not None)
        leaving = row.preempt_requested_at is not None
        if leaving:
            for node in nodes:  # its room is as good as free
                if node in free:
                    free[node][0 if shape.gpus else 1] += shape.gpus or shape.cpus
        live[row.id] = LiveJob(_running(row, shape, nodes, low, high, now, resizable), row.placement_group, leaving)
    running = tuple(job.running for job in live.values() if not job.leaving and job.running.nodes)
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
    queued_jobs: list[QueuedJob] = []
    stored: dict[str, tuple[int | None, str | None]] = {}
    for row in queued:
        shape, low, high = _shape(row.spec)
        queued_jobs.append(
            QueuedJob(
                id=row.id,
                tenant=row.tenant,
                priority=row.priority,
                shape=shape,
                min_workers=low,
                max_workers=high,
                preemptible=bool(row.spec.get("preemptible", True)),
                submitted_at=_seconds(row.created_at, now),
                preempted_for=row.preempted_for,
            )
        )
        stored[row.id] = (row.queue_position, row.waiting_reason)
    views = [
        TenantView(
            name=tenant.name,
            weight=tenant.weight,
            quota_gpus=tenant.quota_gpus,
            quota_cpus=tenant.quota_cpus,
            quota_jobs=tenant.quota_jobs,
        )
        for tenant in tenants
    ]
    state = SchedulingInput(
        now=now,
        nodes=node_views,
        running=running,
        queued=tuple(queued_jobs),
        tenants=ledger.tenant_views(views, now),
        policy=policy,
    )
    return PassInput(state=state, live=live, queued_rows=stored)


def _running(
    row: Row[Any], shape: WorkerShape, nodes: tuple[str, ...], low: int, high: int, now: float, resizable: bool
) -> RunningJob:
    granted = high if row.max_workers is None else min(high, row.max_workers)
    return RunningJob(
        id=row.id,
        tenant=row.tenant,
        priority=row.priority,
        shape=shape,
        nodes=nodes,
        min_workers=low if resizable else max(low, len(nodes)),
        max_workers=max(granted, len(nodes)),
        preemptible=bool(row.spec.get("preemptible", True)),
        started_at=_seconds(row.started_at, now),
        submitted_at=_seconds(row.created_at, now),
    )


def admission_sizes(decided: Plan) -> dict[str, int]:
    """The size each admitted job starts at: its admission, grown in the same plan where the plan grew it."""
    sizes = {admission.job_id: admission.workers for admission in decided.admissions}
    for grow in decided.grows:
        if grow.job_id in sizes:
            sizes[grow.job_id] = grow.workers
    return sizes


def record_queue(session: Session, decided: Plan, stored: dict[str, tuple[int | None, str | None]]) -> int:
    """Write each waiting job's place (1: the next to start; jobs this plan admits are not counted) and why it waits,
    where either changed since the last pass, in one batched statement; returns how many rows changed. Every admission
    moves each job behind it up one place, so a long queue changes most rows at once: the dispatcher records the
    queue only every few seconds (_QUEUE_RECORD_INTERVAL_S)."""
    waiting = [position for position in decided.queue if position.reason]
    changed = [
        {"id": position.job_id, "queue_position": place, "waiting_reason": position.reason}
        for place, position in enumerate(waiting, start=1)
        if stored.get(position.job_id) != (place, position.reason)
    ]
    if changed:
        session.execute(update(Job), changed)  # an UPDATE by primary key, executed for all rows at once
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
