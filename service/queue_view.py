"""What a person sees of the scheduler: the queue in the dispatcher's plan order with why each job waits, each
tenant's fair-share standing, and the share series the web view charts. Reads only what the dispatcher wrote (the
jobs' queue_position and waiting_reason, the tenant_shares series); plans nothing itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, delete, func, select
from sqlalchemy.orm import Session, aliased

from ringmaster.service.models import Job, Tenant, TenantShare
from ringmaster.service.states import JobState
from ringmaster.service.tenants import Quota

SHARE_RETENTION = timedelta(days=7)
"""How long the share series is kept: a week of the dispatcher's samples is what the chart can look back on."""

DEFAULT_SERIES_POINTS = 500
"""Points per tenant a chart gets at most: a week sampled every few seconds is far more than a chart can draw."""


@dataclass(frozen=True)
class WorkerRange:
    """A queued job's size as its stored spec asks for it."""

    min: int
    max: int
    cpus_per_worker: float
    gpus_per_worker: int


@dataclass(frozen=True)
class QueuedJobView:
    position: int | None  # None: queued since the dispatcher's last pass, not placed yet
    id: str
    name: str
    tenant: str
    priority: int
    workers: WorkerRange
    queued_since: datetime
    waiting_reason: str | None
    preemptions: int
    preempted_for: str | None


@dataclass(frozen=True)
class QueuePage:
    """One slice of the queue plus how many jobs match (not service.jobs.Page: telemetry reads this module, and
    service.jobs reads telemetry)."""

    items: list[QueuedJobView]
    total: int
    limit: int
    offset: int


@dataclass(frozen=True)
class TenantStanding:
    """A tenant's weight, quotas and the dispatcher's latest sample of its share (zeros before the first)."""

    name: str
    weight: float
    quota: Quota
    held_gpus: int
    held_cpus: float
    share: float
    decayed_share: float
    entitled_share: float
    sampled_at: datetime | None


@dataclass(frozen=True)
class ShareSample:
    """One tenant's standing at one dispatcher pass: what record_shares stores and share_series returns."""

    tenant: str
    held_gpus: int = 0
    held_cpus: float = 0.0
    share: float = 0.0
    decayed_share: float = 0.0
    entitled_share: float = 0.0


@dataclass(frozen=True)
class SharePoint:
    at: datetime
    share: float
    decayed_share: float
    entitled_share: float
    held_gpus: int
    held_cpus: float


def _worker_range(spec: dict[str, Any]) -> WorkerRange:
    """Read from the stored spec as it is (submit validated it; a full JobSpec validation per row would cost more
    than the whole listing), with JobSpec's defaults for what an older row lacks."""
    workers = spec.get("workers") or {}
    smallest = int(workers.get("min", 1))
    return WorkerRange(
        min=smallest,
        max=int(workers.get("max", smallest)),
        cpus_per_worker=float(workers.get("cpus_per_worker", 1.0)),
        gpus_per_worker=int(workers.get("gpus_per_worker", 0)),
    )


def queue_page(session: Session, *, tenant: str | None, limit: int, offset: int) -> QueuePage:
    """The QUEUED jobs in the plan's order (position, then unplaced ones by priority and age); with tenant, only
    its jobs, their positions still those of the whole queue."""
    queued = select(Job.id).where(Job.state == JobState.QUEUED)
    if tenant is not None:
        queued = queued.where(Job.tenant == tenant)
    # The placed jobs, then the unplaced: each part read in the order of ix_jobs_queue_order, so that a page (however
    # deep) is a slice of an index rather than a sort of every queued row.
    placed = queued.where(Job.queue_position.is_not(None)).order_by(
        Job.queue_position, Job.priority.desc(), Job.created_at, Job.id
    )
    # queue_position leads the unplaced order too (NULL in every row), so that it is ix_jobs_queue_order's exactly: by
    # stale statistics (every queued job unplaced, before the dispatcher's first record) PostgreSQL took ix_jobs_queue
    # for the other three and filtered every queued row (50-80 ms).
    unplaced = queued.where(Job.queue_position.is_(None)).order_by(
        Job.queue_position, Job.priority.desc(), Job.created_at, Job.id
    )
    # The unplaced are the few queued since the last pass; the whole count reads (tenant,) state alone from an index.
    total, unplaced_count = _count(session, queued), _count(session, unplaced)
    placed_count = total - unplaced_count
    # The page's ids first, then their rows (as service.jobs.list_jobs): a deep page skips `offset` entries of the
    # index, never `offset` whole rows with their specs.
    ids = list(session.scalars(placed.limit(limit).offset(offset))) if offset < placed_count else []
    if len(ids) < limit:
        ids += session.scalars(unplaced.limit(limit - len(ids)).offset(max(0, offset - placed_count)))
    rows = {row.id: row for row in session.execute(_queued_rows(ids))} if ids else {}
    items = [
        QueuedJobView(
            position=row.queue_position,
            id=row.id,
            name=row.name,
            tenant=row.tenant,
            priority=row.priority,
            workers=_worker_range(row.spec),
            queued_since=row.created_at,
            waiting_reason=row.waiting_reason,
            preemptions=row.preemptions,
            preempted_for=row.preempted_for,
        )
        for row in (rows[job_id] for job_id in ids if job_id in rows)
    ]
    return QueuePage(items=items, total=total, limit=limit, offset=offset)


def _queued_rows(ids: list[str]) -> Select[Any]:
    """What the view shows of these jobs, of those still queued (one admitted since its id was read is left out)."""
    return select(*_VIEW_COLUMNS).where(Job.id.in_(ids), Job.state == JobState.QUEUED)


# What the view shows of a queued job.
_VIEW_COLUMNS = (
    Job.id,
    Job.name,
    Job.tenant,
    Job.priority,
    Job.spec,
    Job.created_at,
    Job.queue_position,
    Job.waiting_reason,
    Job.preemptions,
    Job.preempted_for,
)


def _count(session: Session, query: Select[Any]) -> int:
    return session.scalar(select(func.count()).select_from(query.order_by(None).subquery())) or 0


def _latest_samples(session: Session, tenant: str | None) -> dict[str, TenantShare]:
    """Each tenant's newest sample (of two at the same instant, the later written): one index probe per tenant
    (ix_tenant_shares_tenant), not a scan of the week of samples."""
    sample = aliased(TenantShare)
    newest = (
        select(sample.id)
        .where(sample.tenant == Tenant.name)
        .order_by(sample.at.desc(), sample.id.desc())
        .limit(1)
        .correlate(Tenant)
        .scalar_subquery()
    )
    ids = select(newest).select_from(Tenant)
    if tenant is not None:
        ids = ids.where(Tenant.name == tenant)
    query = select(TenantShare).where(TenantShare.id.in_(ids))
    return {row.tenant: row for row in session.scalars(query)}


def tenant_standing(session: Session, *, tenant: str | None = None) -> list[TenantStanding]:
    """Every tenant (or the one named) by name, with its latest share sample."""
    query = select(Tenant).order_by(Tenant.name)
    if tenant is not None:
        query = query.where(Tenant.name == tenant)
    samples = _latest_samples(session, tenant)
    standing = []
    for row in session.scalars(query):
        sample = samples.get(row.name)
        standing.append(
            TenantStanding(
                name=row.name,
                weight=row.weight,
                quota=Quota.of(row),
                held_gpus=sample.held_gpus if sample else 0,
                held_cpus=sample.held_cpus if sample else 0.0,
                share=sample.share if sample else 0.0,
                decayed_share=sample.decayed_share if sample else 0.0,
                entitled_share=sample.entitled_share if sample else 0.0,
                sampled_at=sample.at if sample else None,
            )
        )
    return standing


def share_series(
    session: Session, since: datetime, *, tenant: str | None = None, max_points: int = DEFAULT_SERIES_POINTS
) -> dict[str, list[SharePoint]]:
    """Each tenant's samples since a time, oldest first, thinned evenly to at most max_points (the newest kept)."""
    query = select(
        TenantShare.tenant,
        TenantShare.at,
        TenantShare.share,
        TenantShare.decayed_share,
        TenantShare.entitled_share,
        TenantShare.held_gpus,
        TenantShare.held_cpus,
    ).where(TenantShare.at >= since)
    if tenant is not None:
        query = query.where(TenantShare.tenant == tenant)
    series: dict[str, list[SharePoint]] = {}
    for name, at, share, decayed, entitled, gpus, cpus in session.execute(
        query.order_by(TenantShare.tenant, TenantShare.at, TenantShare.id)
    ):
        series.setdefault(name, []).append(SharePoint(at, share, decayed, entitled, gpus, cpus))
    return {name: _thinned(points, max_points) for name, points in series.items()}


def _thinned(points: list[SharePoint], max_points: int) -> list[SharePoint]:
    if len(points) <= max_points:
        return points
    # Every stride-th point counted back from the newest, so the chart always ends at the current standing.
    stride = -(-len(points) // max_points)
    return points[::-1][::stride][::-1]


def record_shares(
    session: Session, at: datetime, samples: Iterable[ShareSample], *, retention: timedelta = SHARE_RETENTION
) -> None:
    """Store one pass's sample of every tenant's standing, and drop the samples older than the retention."""
    session.add_all(
        TenantShare(
            at=at,
            tenant=sample.tenant,
            held_gpus=sample.held_gpus,
            held_cpus=sample.held_cpus,
            share=sample.share,
            decayed_share=sample.decayed_share,
            entitled_share=sample.entitled_share,
        )
        for sample in samples
    )
    session.execute(delete(TenantShare).where(TenantShare.at < at - retention))
    session.flush()
