"""Job lifecycle on the database: the only code that changes a job, so every rule lives in one place.

Functions take a Session inside the caller's transaction (service.db.session_scope) and never
commit; a function that raises leaves the whole transaction to be rolled back, so nothing is
half-written. Each one that changes a job first locks its row (lock_job): FOR UPDATE on
PostgreSQL, the BEGIN IMMEDIATE write lock on SQLite.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar, cast

from sqlalchemy import ColumnElement, Insert, Select, Table, func, insert, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, make_transient_to_detached

from ringmaster.service import code_store, telemetry, tenants
from ringmaster.service.auth import SYSTEM, Principal
from ringmaster.service.errors import UNKNOWN_REFERENCE, CodeNotFound, InvalidSpec, JobConflict, JobNotFound
from ringmaster.service.job_plan import ClusterShape, plan_submission, predicted_rank_state
from ringmaster.service.models import Attempt, Checkpoint, Job, JobEvent, MemoryMeasurement, Metric, utcnow
from ringmaster.service.naming import JOB_ID_LENGTH
from ringmaster.service.planner import StateMemory
from ringmaster.service.reports import CheckpointRecord, DriverReport, MetricPoint, StoredCheckpoint
from ringmaster.service.spec import JobSpec
from ringmaster.service.states import ACTIVE, TERMINAL, JobState, check_transition

T = TypeVar("T")
log = logging.getLogger(__name__)
# The metric columns a report fills in: MetricPoint's values (its step and attempt name the row).
_METRIC_VALUES = tuple(name for name in MetricPoint.model_fields if name not in ("step", "attempt"))
_DIALECT_INSERTS: dict[str, Callable[[Table], sqlite.Insert | postgresql.Insert]] = {
    "sqlite": sqlite.insert,
    "postgresql": postgresql.insert,
}
# Declarative maps each model to a Table, which SQLAlchemy's types leave as any FromClause.
_JOBS, _JOB_EVENTS, _METRICS = (cast(Table, model.__table__) for model in (Job, JobEvent, Metric))


@dataclass(frozen=True)
class Page(Generic[T]):
    """One slice of a listing plus the total, so clients can page without guessing."""

    items: list[T]
    total: int
    limit: int
    offset: int


@dataclass(frozen=True)
class RankMemoryComparison:
    """One rank's measured training state beside the planner's prediction for it (None when it cannot predict)."""

    measurement: MemoryMeasurement
    predicted: StateMemory | None

    @property
    def measured_total(self) -> int:
        row = self.measurement
        return row.parameters_bytes + row.gradients_bytes + row.optimizer_bytes

    @property
    def ratio(self) -> float | None:
        """Measured over predicted total; 1.0 is a perfect prediction."""
        if self.predicted is None or not self.predicted.total:
            return None
        return self.measured_total / self.predicted.total


@dataclass(frozen=True)
class ReportResult:
    """What the driver learns from a report: the job's state now, and whether its attempt goes on (False: the report was
    refused, or it ended the job, e.g. a recovery past max_failures)."""

    state: JobState
    accepted: bool
    # True while the dispatcher asks this attempt to stop (for preempted_for's job; None: its node drains): the driver
    # saves its state at its next step, reports PREEMPTED and ends.
    preempting: bool = False
    preempted_for: str | None = None


def _plausible_id(job_id: str) -> bool:
    """Job ids are 32 hex digits; anything else (too long, NUL, non-ASCII) is unknown without asking the database."""
    return len(job_id) <= JOB_ID_LENGTH and job_id.isascii() and job_id.isalnum()


def get_job(session: Session, job_id: str, tenant: str | None = None) -> Job:
    """The job; with tenant, another tenant's job is not found, exactly like an unknown id."""
    job = session.get(Job, job_id) if _plausible_id(job_id) else None
    if job is None or (tenant is not None and job.tenant != tenant):
        raise JobNotFound(job_id[:64])
    return job


def lock_job(session: Session, job_id: str, tenant: str | None = None) -> Job:
    """Re-read the job under a row lock so a read-modify-write cannot interleave with another writer."""
    job = session.get(Job, job_id, with_for_update=True, populate_existing=True) if _plausible_id(job_id) else None
    if job is None or (tenant is not None and job.tenant != tenant):
        raise JobNotFound(job_id[:64])
    return job


# The job's nullable columns without a default, NULL at submission: with them set, the Job handed back has every
# attribute loaded (an unset one would cost a query when read).
_JOB_UNSET: dict[str, None] = {
    column.key: None
    for column in Job.__table__.columns
    if column.nullable and column.default is None and column.server_default is None
}


def submit_job(
    session: Session, spec: JobSpec, cluster: ClusterShape | None = None, principal: Principal = SYSTEM
) -> Job:
    """Record a validated spec as a QUEUED job of the principal's tenant, with its first event.

    The planner runs first: ``auto`` is stored as the strategy it resolves to (with a "plan" event saying
    why), and a job that cannot fit its GPUs or nodes, or the tenant's quota even alone, raises InvalidSpec
    before anything is written. resume_from must name a job the principal may read (an unambiguous prefix of its id
    is stored as the whole id), and code an archive of its tenant.
    """
    if spec.resume_from is not None:
        spec = spec.model_copy(update={"resume_from": _resumed_job_id(session, spec.resume_from, principal)})
    if spec.code is not None and not code_store.has_archive(session, principal.tenant, spec.code):
        raise InvalidSpec(
            [
                {
                    "type": UNKNOWN_REFERENCE,
                    "loc": ["code"],
                    "msg": str(CodeNotFound(spec.code, principal.tenant)),
                    "input": spec.code,
                }
            ]
        )
    rejections = tenants.submit_rejections(spec, tenants.get_tenant(session, principal.tenant))
    if rejections:
        raise InvalidSpec(rejections)
    planned = plan_submission(spec, cluster)
    spec = planned.spec
    now = utcnow()
    row = _JOB_UNSET | {
        "id": uuid.uuid4().hex,
        "name": spec.name,
        "spec": spec.model_dump(mode="json"),
        "state": JobState.QUEUED,
        "priority": spec.priority,
        "attempt": 0,
        "failures": 0,
        "preemptions": 0,
        "created_at": now,
        "cancel_requested": False,
        "tenant": principal.tenant,
    }
    # Plain INSERTs, the job before the events that refer to it: the unit of work made this transaction a quarter
    # slower.
    connection = session.connection()
    connection.execute(insert(_JOBS), row)
    connection.execute(
        insert(_JOB_EVENTS),
        {
            "job_id": row["id"],
            "at": now,
            "from_state": None,
            "to_state": JobState.QUEUED,
            "kind": "transition",
            "message": "submitted",
        },
    )
    if planned.message is not None:
        connection.execute(
            insert(_JOB_EVENTS),
            {"job_id": row["id"], "at": now, "kind": "plan", "message": planned.message, "data": planned.data},
        )
    job = Job(**row)
    make_transient_to_detached(job)  # as if loaded from its row: the session holds it and will not insert it again
    session.add(job)
    return job


def transition(session: Session, job: Job, target: JobState, message: str, data: dict[str, Any] | None = None) -> Job:
    """The one place a job changes state: checks the table, stamps the time, records the event."""
    job = lock_job(session, job.id)
    current = JobState(job.state)
    check_transition(current, target)
    now = utcnow()
    job.state = target
    if target != JobState.QUEUED:
        job.queue_position = None  # a place in the queue is the dispatcher's to give, at its next plan
    if target == JobState.ADMITTED:
        job.admitted_at = now
    elif target == JobState.RUNNING and job.started_at is None:
        job.started_at = now  # the first start: a recovery or a later attempt runs on within the same job
    elif target in TERMINAL:
        job.finished_at = now
    if target == JobState.FAILED:
        job.error = message
    telemetry.record_transition(session, job, current, target, now)  # counted once the transaction commits
    session.add(
        JobEvent(
            job_id=job.id, at=now, from_state=current, to_state=target, kind="transition", message=message, data=data
        )
    )
    session.flush()
    log.info(
        "job %s: %s -> %s: %s",
        job.id,
        current.value,
        target.value,
        message,
        extra={"job_id": job.id, "from_state": current.value, "to_state": target.value},
    )
    return job


def cancel_job(session: Session, job_id: str, tenant: str | None = None) -> Job:
    """Cancel at once in the database; the dispatcher then stops the Ray job (see attempts_to_close)."""
    job = lock_job(session, job_id, tenant)
    if job.state in TERMINAL:
        raise JobConflict(f"job {job_id} already finished as {job.state}; there is nothing to cancel")
    job.cancel_requested = True
    return transition(session, job, JobState.CANCELLED, "cancelled on request")


def _resumed_job_id(session: Session, reference: str, principal: Principal) -> str:
    """The id of the job resume_from names: its whole id, or an unambiguous prefix of one (`ringmaster status` lists
    ids by their first 12 digits), among the jobs the principal may read. A whole id is the prefix of itself alone."""
    shown = 3
    matches = (
        list_jobs(session, limit=shown, tenant=principal.scope, id_prefix=reference)
        if _plausible_id(reference)
        else None
    )
    if matches is None or matches.total == 0:
        problem = f"no job with id {reference[:64]!r}" + (
            "" if len(reference) >= JOB_ID_LENGTH else ", nor one whose id starts with it"
        )
    elif matches.total == 1:
        return matches.items[0].id
    else:
        listed = ", ".join(job.id[:12] for job in matches.items) + (" and more" if matches.total > shown else "")
        problem = f"{reference!r} is the start of {matches.total} job ids ({listed}): give more of the id"
    raise InvalidSpec(
        [{"type": UNKNOWN_REFERENCE, "loc": ["resume_from"], "msg": f"resume_from: {problem}", "input": reference}]
    )


def list_jobs(
    session: Session,
    state: JobState | None = None,
    limit: int = 50,
    offset: int = 0,
    tenant: str | None = None,
    id_prefix: str | None = None,
) -> Page[Job]:
    """Newest first; with tenant, only that tenant's jobs; with id_prefix, only ids that start with it."""
    query = select(Job)
    if state is not None:
        query = query.where(Job.state == state)
    if id_prefix:
        query = query.where(Job.id.startswith(id_prefix, autoescape=True))
    if tenant is not None:
        query = query.where(Job.tenant == tenant)
    total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
    # The page's ids first, then their rows: a deep page skips `offset` entries of the listing's index rather than
    # `offset` whole rows with their specs (PostgreSQL read every one of them: 120-200 ms at offset 99,900).
    ids = list(
        session.scalars(
            query.with_only_columns(Job.id).order_by(Job.created_at.desc(), Job.id).limit(limit).offset(offset)
        )
    )
    rows = {job.id: job for job in session.scalars(select(Job).where(Job.id.in_(ids)))} if ids else {}
    return Page(items=[rows[job_id] for job_id in ids if job_id in rows], total=total, limit=limit, offset=offset)


@dataclass(frozen=True)
class Progress:
    """Where a job's training stands: its newest step, its newest validation (train.eval_every_steps), and for an
    active job the time left at its recent pace."""

    step: int
    total_steps: int | None  # None: a script job, whose own loop alone knows its steps
    loss: float | None
    world_size: int | None
    samples_per_s: float | None
    recoveries: int
    eta_s: float | None
    val_loss: float | None = None
    val_step: int | None = None

    @staticmethod
    def not_started(total_steps: int | None) -> Progress:
        return Progress(0, total_steps, None, None, None, 0, None)


_PACE_STEPS = 20  # the ETA's pace: the wall time over this many newest steps


def job_progress(session: Session, job: Job) -> Progress:
    total = None if job.spec.get("command") else int(job.spec.get("train", {}).get("steps", 0))
    newest = list(
        session.scalars(
            select(Metric)
            .where(Metric.job_id == job.id, Metric.loss.is_not(None))
            .order_by(Metric.attempt.desc(), Metric.step.desc())
            .limit(_PACE_STEPS)
        )
    )
    recoveries = (
        session.scalar(
            select(func.count())
            .select_from(JobEvent)
            .where(JobEvent.job_id == job.id, JobEvent.to_state == JobState.RECOVERING.value)
        )
        or 0
    )
    validated = session.scalars(
        select(Metric)
        .where(Metric.job_id == job.id, Metric.val_loss.is_not(None))
        .order_by(Metric.attempt.desc(), Metric.step.desc())
        .limit(1)
    ).first()
    val_loss, val_step = (validated.val_loss, validated.step) if validated else (None, None)
    if not newest:
        return replace(Progress.not_started(total), recoveries=recoveries, val_loss=val_loss, val_step=val_step)
    latest, oldest = newest[0], newest[-1]
    eta = None
    if (
        total is not None
        and JobState(job.state) in ACTIVE
        and latest.wall_time
        and oldest.wall_time
        and latest.step > oldest.step
    ):
        seconds_per_step = (latest.wall_time - oldest.wall_time) / (latest.step - oldest.step)
        eta = max(0.0, (total - latest.step) * seconds_per_step)
    return Progress(
        latest.step, total, latest.loss, latest.world_size, latest.samples_per_s, recoveries, eta, val_loss, val_step
    )


def list_events(
    session: Session, job_id: str, limit: int = 1000, offset: int = 0, tenant: str | None = None
) -> Page[JobEvent]:
    get_job(session, job_id, tenant)
    query = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
    return _page(session, query, limit, offset)


def list_metrics(
    session: Session, job_id: str, limit: int = 1000, offset: int = 0, tenant: str | None = None
) -> Page[Metric]:
    get_job(session, job_id, tenant)
    query = select(Metric).where(Metric.job_id == job_id).order_by(Metric.attempt, Metric.step)
    return _page(session, query, limit, offset)


def list_checkpoints(
    session: Session, job_id: str, limit: int = 1000, offset: int = 0, tenant: str | None = None
) -> Page[Checkpoint]:
    get_job(session, job_id, tenant)
    query = (
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id)
        .order_by(Checkpoint.attempt, Checkpoint.step, Checkpoint.id)
    )
    return _page(session, query, limit, offset)


def list_memory(session: Session, job_id: str, tenant: str | None = None) -> list[RankMemoryComparison]:
    """Every rank's measured state memory, by attempt and rank, beside the planner's prediction from the job's spec."""
    job = get_job(session, job_id, tenant)
    spec = JobSpec.model_validate(job.spec)
    query = select(MemoryMeasurement).where(MemoryMeasurement.job_id == job_id)
    rows = session.scalars(query.order_by(MemoryMeasurement.attempt, MemoryMeasurement.rank))
    return [
        RankMemoryComparison(row, predicted_rank_state(spec, row.parameter_count, row.dp, row.tp, row.pp))
        for row in rows
    ]


def _page(session: Session, query: Select[T], limit: int, offset: int) -> Page[T]:
    total = session.scalar(select(func.count()).select_from(query.order_by(None).subquery())) or 0
    items = list(session.scalars(query.limit(limit).offset(offset)))
    return Page(items=items, total=total, limit=limit, offset=offset)


def apply_driver_report(session: Session, job_id: str, attempt_number: int, report: DriverReport) -> ReportResult:
    """Store a driver's batch idempotently; a report from a superseded attempt or a finished job changes nothing."""
    job = lock_job(session, job_id)
    if attempt_number != job.attempt or job.state not in ACTIVE:
        return ReportResult(state=JobState(job.state), accepted=False)
    attempt = session.scalars(select(Attempt).where(Attempt.job_id == job.id, Attempt.number == attempt_number)).one()
    attempt.last_report_at = utcnow()  # a replay too: either way the driver is alive
    if report.seq is not None:
        if report.seq <= attempt.last_report_seq:
            return ReportResult(state=JobState(job.state), accepted=True)  # a replay: applied already
        attempt.last_report_seq = report.seq
    _upsert_metrics(session, job, report)
    _record_checkpoints(session, job, report)
    _upsert_memory(session, job, report)
    details = {"attempt": attempt_number, **report.details}
    if report.state is not None and report.state != job.state:
        target = JobState(report.state)
        message = report.message or f"driver reported {target}"
        if target == JobState.RECOVERING and (exhausted := count_failure(job)):
            # The attempt is over: the answer (not accepted) tells its driver to stop.
            transition(session, job, JobState.FAILED, f"{message}; {exhausted}", details)
            return ReportResult(state=JobState(job.state), accepted=False)
        if target == JobState.PREEMPTED:
            job.preempt_requested_at = None
        transition(session, job, target, message, details)
        if target == JobState.PREEMPTED:
            return ReportResult(state=JobState(job.state), accepted=False)  # stopped: the attempt is over
    elif report.message:
        session.add(JobEvent(job_id=job.id, at=utcnow(), kind="info", message=report.message, data=details))
    restore_s = report.details.get("restore_s")
    if isinstance(restore_s, (int, float)) and not isinstance(restore_s, bool):
        telemetry.record_checkpoint_timing(session, restore_s=float(restore_s))
    preempting = job.preempt_requested_at is not None
    return ReportResult(
        state=JobState(job.state),
        accepted=True,
        preempting=preempting,
        preempted_for=job.preempted_for if preempting else None,
    )


def _upsert_metrics(session: Session, job: Job, report: DriverReport) -> None:
    """One row per (job, attempt, step): a replay or a later report for the step fills in its non-null fields.
    A point names its attempt when an earlier attempt ran it (replayed from a checkpoint; the route refuses later ones).
    One INSERT … ON CONFLICT DO UPDATE for the batch, not an ORM object per row: a driver reports every step, dozens
    a second per job, and this halves a report's database time."""
    merged: dict[tuple[int, int], dict[str, Any]] = {}
    for point in report.metrics:  # a step's points (its training point, a val_loss point) as one row's values
        merged.setdefault((point.attempt or job.attempt, point.step), {}).update(
            point.model_dump(exclude={"step", "attempt"}, exclude_none=True)
        )
    if not merged:
        return
    now = utcnow()
    session.execute(
        _metric_upsert(session.get_bind().dialect.name),
        [
            {
                "job_id": job.id,
                "attempt": attempt,
                "step": step,
                "recorded_at": now,
                **{name: values.get(name) for name in _METRIC_VALUES},
            }
            for (attempt, step), values in merged.items()
        ],
    )


@functools.cache
def _metric_upsert(dialect: str) -> Insert:
    """The metric rows' INSERT … ON CONFLICT DO UPDATE in this dialect, built once: building it for every report cost
    half as much again as running it for a second's points."""
    table = _METRICS
    statement = _DIALECT_INSERTS[dialect](table)
    return statement.on_conflict_do_update(
        index_elements=[table.c.job_id, table.c.attempt, table.c.step],
        set_={name: func.coalesce(statement.excluded[name], table.c[name]) for name in _METRIC_VALUES},
    )


def _record_checkpoints(session: Session, job: Job, report: DriverReport) -> None:
    """A checkpoint is known by its URI: its first report is stored and announced as an event. Each record
    also says what retention did on storage, and the rows follow: a deleted checkpoint's row goes, and
    ``best`` marks the one kept as the best by checkpoint.keep_best's metric. Where a record lists every checkpoint
    kept on storage, the rows become exactly those: a worker lost between a commit and its report took that record
    (the commit, and what its retention deleted) with it."""
    if not report.checkpoints:
        return
    rows = {row.uri: row for row in session.scalars(select(Checkpoint).where(Checkpoint.job_id == job.id))}
    now = utcnow()

    def store(record: CheckpointRecord | StoredCheckpoint, final: bool, note: str = "") -> None:
        telemetry.record_checkpoints(session, 1)
        rows[record.uri] = Checkpoint(
            job_id=job.id,
            attempt=job.attempt,
            step=record.step,
            uri=record.uri,
            world_size=record.world_size,
            final=final,
            created_at=now,
            metric=record.metric,
            metric_value=record.metric_value,
            best=False,
        )
        session.add(rows[record.uri])
        value = (
            f" ({record.metric} {record.metric_value:.6g})" if record.metric and record.metric_value is not None else ""
        )
        session.add(
            JobEvent(
                job_id=job.id,
                at=now,
                kind="checkpoint",
                message=f"{'final ' if final else ''}checkpoint at step {record.step}{value}{note}",
                data={"attempt": job.attempt, **record.model_dump(mode="json", exclude={"kept"})},
            )
        )

    def drop(uri: str) -> None:
        deleted = rows.pop(uri, None)
        if deleted is None:
            return
        if deleted in session.new:
            session.expunge(deleted)  # stored and deleted within this one report
        else:
            session.delete(deleted)

    for record in report.checkpoints:
        if record.uri not in rows:
            telemetry.record_checkpoint_timing(session, save_s=record.save_s, blocked_s=record.blocked_s)
            store(record, record.final)
        if record.kept is None:
            for uri in record.deleted_uris:
                drop(uri)
        else:  # what retention deleted is not among what it kept
            kept = {stored.uri for stored in record.kept}
            for uri in [uri for uri in rows if uri not in kept]:
                drop(uri)
            for stored in record.kept:
                if stored.uri not in rows and stored.world_size is not None:
                    store(stored, final=False, note=" (committed by a worker lost before it reported it)")
        if record.best_uri is not None:
            for row in rows.values():
                row.best = row.uri == record.best_uri
    session.flush()


def _upsert_memory(session: Session, job: Job, report: DriverReport) -> None:
    """One row per (job, attempt, rank): a replay changes nothing, a later measurement of the rank replaces it."""
    by_rank = {measured.rank: measured for measured in report.memory}
    if not by_rank:
        return
    query = select(MemoryMeasurement).where(
        MemoryMeasurement.job_id == job.id,
        MemoryMeasurement.attempt == job.attempt,
        MemoryMeasurement.rank.in_(by_rank),
    )
    rows = {row.rank: row for row in session.scalars(query)}
    now = utcnow()
    for rank, measured in by_rank.items():
        values = measured.model_dump(exclude={"rank"})
        row = rows.get(rank)
        if row is None:
            session.add(MemoryMeasurement(job_id=job.id, attempt=job.attempt, rank=rank, recorded_at=now, **values))
        elif any(getattr(row, field) != value for field, value in values.items()):
            for field, value in values.items():
                setattr(row, field, value)
            row.recorded_at = now
    session.flush()


def mark_admitted(
    session: Session,
    job: Job,
    attempt_number: int,
    submission_id: str,
    placement_group: str | None,
    world_size: int | None,
    *,
    max_workers: int | None = None,
    report_token_hash: str | None = None,
) -> Job:
    """Record a new attempt the dispatcher has placed on Ray and move the job to ADMITTED.

    max_workers is what the tenant's quota granted (the driver grows no further); report_token_hash is the hash
    of the secret the attempt's driver reports with.
    """
    job = lock_job(session, job.id)
    if attempt_number <= job.attempt:
        raise JobConflict(f"attempt {attempt_number} of job {job.id} is not newer than its attempt {job.attempt}")
    job = transition(
        session,
        job,
        JobState.ADMITTED,
        f"attempt {attempt_number} admitted",
        {
            "attempt": attempt_number,
            "submission_id": submission_id,
            "placement_group": placement_group,
            "world_size": world_size,
        },
    )
    session.add(
        Attempt(
            job_id=job.id,
            number=attempt_number,
            submission_id=submission_id,
            placement_group=placement_group,
            world_size=world_size,
            started_at=utcnow(),
            max_workers=max_workers,
            report_token_hash=report_token_hash,
        )
    )
    job.attempt = attempt_number
    job.submission_id = submission_id
    job.lease_owner = job.lease_expires_at = None
    job.waiting_reason = None
    session.flush()
    return job


def count_failure(job: Job) -> str | None:
    """The one count of a job's failures against spec.max_failures: a lost attempt (the dispatcher) and a recovery
    inside one (its driver's RECOVERING report) each count once. Returns why the job must fail, once the count
    exceeds max_failures; else None."""
    job.failures += 1
    max_failures = JobSpec.model_validate(job.spec).max_failures
    return f"failure {job.failures}, max_failures {max_failures}" if job.failures > max_failures else None


def requeue(session: Session, job: Job, message: str, *, failure: bool = False) -> Job:
    """Put an admitted job back in the queue; a counted failure beyond spec.max_failures fails it instead."""
    job = lock_job(session, job.id)
    job.lease_owner = job.lease_expires_at = None
    if failure and (exhausted := count_failure(job)):
        return transition(session, job, JobState.FAILED, f"{message} ({exhausted})")
    return transition(session, job, JobState.QUEUED, message, {"attempt": job.attempt, "failures": job.failures})


def request_preemption(session: Session, job: Job, for_job: str | None, reason: str) -> bool:
    """Ask a running job's driver to save and stop, for `for_job` (None: its node is draining); False when the job is
    no longer running (ended, or asked already)."""
    job = lock_job(session, job.id)
    if job.state not in ACTIVE or job.preempt_requested_at is not None:
        return False
    job.preempt_requested_at = utcnow()
    job.preempted_for = for_job
    session.add(
        JobEvent(
            job_id=job.id,
            at=job.preempt_requested_at,
            kind="info",
            message=f"preempting: {reason}; it saves its state and stops at its next step",
            data={"attempt": job.attempt, "preempted_for": for_job},
        )
    )
    return True


def preempted(session: Session, job: Job, message: str) -> Job:
    """The dispatcher's end of a preemption its driver did not report in time: the attempt is stopped, and the job
    resumes from its latest checkpoint."""
    job = lock_job(session, job.id)
    job.preempt_requested_at = None
    return transition(session, job, JobState.PREEMPTED, message, {"attempt": job.attempt})


def queue_again(session: Session, job: Job) -> Job:
    """A preempted job whose attempt is closed goes back to the queue in its old place (its created_at), not counted
    as a failure."""
    job = lock_job(session, job.id)
    job.preemptions += 1
    job.lease_owner = job.lease_expires_at = None
    for_job = f" for job {job.preempted_for}" if job.preempted_for else ""
    return transition(
        session,
        job,
        JobState.QUEUED,
        f"preempted{for_job}: queued again in its place; it resumes from the state it saved",
        {"attempt": job.attempt, "preemptions": job.preemptions, "preempted_for": job.preempted_for},
    )


def attempts_to_close(session: Session) -> list[Attempt]:
    """Open attempts that are no longer the live attempt of a live job: their Ray job and placement group must go."""
    superseded: ColumnElement[bool] = or_(
        Job.state.in_(TERMINAL),
        Job.state.in_([JobState.QUEUED, JobState.PREEMPTED]),
        Job.attempt != Attempt.number,
    )
    query = select(Attempt).join(Job, Job.id == Attempt.job_id).where(Attempt.ended_at.is_(None), superseded)
    return list(session.scalars(query.order_by(Attempt.id)))


def close_attempt(session: Session, attempt: Attempt, outcome: str) -> Attempt:
    """Mark an attempt's Ray resources as released; a second close (another replica) changes nothing."""
    row = session.get(Attempt, attempt.id, with_for_update=True, populate_existing=True)
    if row is None:
        raise JobConflict(f"attempt {attempt.id} does not exist")
    if row.ended_at is None:
        row.ended_at = utcnow()
        row.outcome = outcome
        session.add(
            JobEvent(
                job_id=row.job_id,
                at=row.ended_at,
                kind="info",
                message=f"attempt {row.number} closed: {outcome}",
                data={"attempt": row.number, "submission_id": row.submission_id, "outcome": outcome},
            )
        )
        session.flush()
    return row
