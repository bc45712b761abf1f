"""SQLAlchemy tables of the control plane; the database is its only state."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC in and out: SQLite has no time zones, so it stores naive UTC and we re-attach it."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given where UTC is required")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UTCDateTime, dict[str, Any]: JSON}


DEFAULT_TENANT = "default"
"""Owns the jobs from before tenants existed and the local admin token of an embedded server."""


class Tenant(Base):
    """A team: its jobs are visible only to it (and admins); null quotas are unlimited."""

    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    quota_gpus: Mapped[int | None] = mapped_column(Integer)
    quota_cpus: Mapped[float | None] = mapped_column(Float)
    quota_jobs: Mapped[int | None] = mapped_column(Integer)
    # Its weight in fair share: among jobs of equal priority, capacity goes to the tenant furthest below its weighted
    # share of the cluster.
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class TenantShare(Base):
    """A tenant's standing as the dispatcher saw it at one pass: what its jobs held, its share of the cluster (dominant
    resource: the larger of its GPU and CPU fractions), the decayed share fair share orders by, and its weighted
    entitlement. Written every few passes, as the series the queue view draws."""

    __tablename__ = "tenant_shares"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    tenant: Mapped[str] = mapped_column(String(64))
    held_gpus: Mapped[int] = mapped_column(Integer, default=0)
    held_cpus: Mapped[float] = mapped_column(Float, default=0.0)
    share: Mapped[float] = mapped_column(Float, default=0.0)  # of the cluster now, 0..1
    decayed_share: Mapped[float] = mapped_column(Float, default=0.0)  # over the recent past (half-life setting)
    entitled_share: Mapped[float] = mapped_column(Float, default=0.0)  # weight / the weights of tenants with work

    __table_args__ = (
        Index("ix_tenant_shares_at", "at"),  # the retention's delete and the series since a time
        Index("ix_tenant_shares_tenant", "tenant", "at", "id"),  # each tenant's newest sample, found without a scan
    )


class ApiToken(Base):
    """A bearer token, stored only as the SHA-256 of its secret; revoking keeps the row for the record."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"), index=True)
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    description: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class CodeArchive(Base):
    """A job's code as uploaded (a zip), content-addressed by its SHA-256 within its tenant; kept in the database, the
    control plane's only state, so every replica and every later attempt of a job finds it."""

    __tablename__ = "code_archives"

    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"), primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    unpacked_bytes: Mapped[int] = mapped_column(BigInteger)
    files: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    content: Mapped[bytes] = mapped_column(LargeBinary, deferred=True)  # read only when a dispatcher hands it to Ray


class MlflowRun(Base):
    """A job's MLflow run (RINGMASTER_MLFLOW_TRACKING_URI) and how far its metrics and checkpoints were exported."""

    __tablename__ = "mlflow_runs"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    run_id: Mapped[str | None] = mapped_column(String(64))
    metric_cursor: Mapped[int] = mapped_column(Integer, default=0)  # the last metrics.id logged
    checkpoint_cursor: Mapped[int] = mapped_column(Integer, default=0)  # the last checkpoints.id tagged
    finished: Mapped[bool] = mapped_column(default=False)  # the run was ended with the job's final state


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: uuid.uuid4().hex)
    name: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    failures: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    admitted_at: Mapped[datetime | None]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    error: Mapped[str | None] = mapped_column(Text)
    submission_id: Mapped[str | None] = mapped_column(String(255))
    lease_owner: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[datetime | None]
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # No foreign key to tenants: SQLite cannot add one to an existing table inside the upgrade's transaction.
    # Tenants are never deleted, and a job is only ever created for the tenant of an authenticated token.
    tenant: Mapped[str] = mapped_column(String(64), server_default=DEFAULT_TENANT)
    # Why the dispatcher left it QUEUED at its last pass (over quota, no capacity); cleared on admission.
    waiting_reason: Mapped[str | None] = mapped_column(Text)
    # Its place in the dispatcher's last plan (1 = next to start); None when not queued.
    queue_position: Mapped[int | None] = mapped_column(Integer)
    # The job whose admission preempts (or preempted) this one: set when the dispatcher asks its driver to stop, kept
    # once it is queued again so that it never preempts that job back (no cycles).
    preempted_for: Mapped[str | None] = mapped_column(String(32))
    preempt_requested_at: Mapped[datetime | None]  # when its driver was asked to stop; None once it stopped
    preemptions: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


# Serves claim_next: WHERE state = 'QUEUED' ORDER BY priority DESC, created_at.
Index("ix_jobs_queue", Job.state, Job.priority.desc(), Job.created_at)
# The listings in their exact order (newest first, then id), for every filter GET /v1/jobs takes: a page, however
# deep, is read from the index in order instead of sorting every matching row (migration 0012).
_NEWEST = (Job.created_at.desc(), Job.id)
Index("ix_jobs_newest", *_NEWEST)
Index("ix_jobs_state", Job.state, *_NEWEST)
Index("ix_jobs_tenant", Job.tenant, *_NEWEST)
Index("ix_jobs_tenant_state", Job.tenant, Job.state, *_NEWEST)  # also a tenant's active jobs (its usage)
# The queue view's order: the placed jobs by their place, then the unplaced by priority and age.
Index("ix_jobs_queue_order", Job.state, Job.queue_position, Job.priority.desc(), Job.created_at, Job.id)
# What the dispatcher reads of every queued and active job each pass, read from the index alone (migration 0013).
Index("ix_jobs_dispatch", Job.state, Job.id, Job.attempt, Job.preempt_requested_at)


class JobEvent(Base):
    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str | None] = mapped_column(String(16))
    kind: Mapped[str] = mapped_column(String(32))
    message: Mapped[str | None] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None]


class Attempt(Base):
    __tablename__ = "attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    number: Mapped[int] = mapped_column(Integer)
    submission_id: Mapped[str] = mapped_column(String(255), unique=True)
    placement_group: Mapped[str | None] = mapped_column(String(255))
    world_size: Mapped[int | None] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]
    outcome: Mapped[str | None] = mapped_column(String(32))
    # The driver numbers its reports; one at or below this was applied already (a replay).
    last_report_seq: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # When the driver's last report arrived (this replica's clock): a driver that reports is alive.
    last_report_at: Mapped[datetime | None]
    # SHA-256 of the secret the driver reports with; only this attempt's driver holds the secret.
    report_token_hash: Mapped[str | None] = mapped_column(String(64))
    # The most workers the tenant's quota granted at admission: the driver never grows past it.
    max_workers: Mapped[int | None] = mapped_column(Integer)

    __table_args__ = (
        UniqueConstraint("job_id", "number"),
        # The few attempts still open, which every dispatcher pass reads (attempts_to_close) among every one ever run.
        Index(
            "ix_attempts_open", "id", sqlite_where=text("ended_at IS NULL"), postgresql_where=text("ended_at IS NULL")
        ),
    )


class Metric(Base):
    __tablename__ = "metrics"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    val_loss: Mapped[float | None] = mapped_column(Float)
    samples_per_s: Mapped[float | None] = mapped_column(Float)
    step_time_s: Mapped[float | None] = mapped_column(Float)
    wall_time: Mapped[float | None] = mapped_column(Float)
    lr: Mapped[float | None] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float)
    world_size: Mapped[int | None] = mapped_column(Integer)
    # The user's own metrics by name (MetricPoint.user_metrics); SQL NULL, not JSON null, where a step has none, so
    # that a later report for the step keeps them (jobs._metric_upsert's COALESCE).
    user_metrics: Mapped[dict[str, float] | None] = mapped_column(JSON(none_as_null=True))
    recorded_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (
        UniqueConstraint("job_id", "attempt", "step"),
        # The newest validation of a job (its progress) among its steps' rows, most without one: read without
        # scanning every step the job ran.
        Index(
            "ix_metrics_validated",
            "job_id",
            "attempt",
            "step",
            sqlite_where=text("val_loss IS NOT NULL"),
            postgresql_where=text("val_loss IS NOT NULL"),
        ),
        # The MLflow export's next rows of a job after its cursor, in the order they were stored.
        Index("ix_metrics_job_id_id", "job_id", "id"),
    )


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(String(1024))
    world_size: Mapped[int] = mapped_column(Integer)
    final: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # checkpoint.keep_best: the metric, this checkpoint's value of it, and whether retention keeps it as the best.
    metric: Mapped[str | None] = mapped_column(String(32))
    metric_value: Mapped[float | None] = mapped_column(Float)
    best: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    __table_args__ = (UniqueConstraint("job_id", "uri"),)


class MemoryMeasurement(Base):
    """Bytes of training state one rank measured in one attempt (DriverReport.memory); the last report wins."""

    __tablename__ = "memory_measurements"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    parameter_count: Mapped[int] = mapped_column(BigInteger)
    parameters_bytes: Mapped[int] = mapped_column(BigInteger)
    gradients_bytes: Mapped[int] = mapped_column(BigInteger)
    optimizer_bytes: Mapped[int] = mapped_column(BigInteger)
    dp: Mapped[int] = mapped_column(Integer)
    tp: Mapped[int] = mapped_column(Integer)
    pp: Mapped[int] = mapped_column(Integer)
    recorded_at: Mapped[datetime] = mapped_column(default=utcnow)

    __table_args__ = (UniqueConstraint("job_id", "attempt", "rank"),)
