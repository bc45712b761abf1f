"""Response bodies of the REST API, kept apart from the tables; each converts from its row explicitly."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, Field

from service import jobs
from service.models import Checkpoint, Job, JobEvent, Metric
from service.settings import Settings
from service.states import JobState

Row = TypeVar("Row")
Item = TypeVar("Item", bound=BaseModel)


class JobOut(BaseModel):
    id: str
    name: str
    state: JobState
    attempt: int = Field(description="Current attempt number; 0 before the first dispatch.")
    failures: int
    priority: int
    created_at: datetime
    admitted_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None
    ray_job_id: str | None = Field(description="Ray Jobs API submission id of the current attempt.")
    dashboard_url: str | None = Field(description="The current attempt in the Ray dashboard, when both are known.")
    spec: dict[str, Any] = Field(description="The submitted JobSpec, with defaults filled in.")

    @classmethod
    def from_row(cls, job: Job, settings: Settings) -> "JobOut":
        dashboard_url = None
        if settings.ray_dashboard_url and job.submission_id:
            dashboard_url = f"{settings.ray_dashboard_url.rstrip('/')}/#/jobs/{job.submission_id}"
        return cls(
            id=job.id,
            name=job.name,
            state=JobState(job.state),
            attempt=job.attempt,
            failures=job.failures,
            priority=job.priority,
            created_at=job.created_at,
            admitted_at=job.admitted_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            error=job.error,
            ray_job_id=job.submission_id,
            dashboard_url=dashboard_url,
            spec=job.spec,
        )


class EventOut(BaseModel):
    id: int
    job_id: str
    at: datetime
    kind: str = Field(description="transition, checkpoint or info.")
    from_state: JobState | None
    to_state: JobState | None
    message: str | None
    data: dict[str, Any] | None

    @classmethod
    def from_row(cls, event: JobEvent) -> "EventOut":
        return cls(
            id=event.id,
            job_id=event.job_id,
            at=event.at,
            kind=event.kind,
            from_state=JobState(event.from_state) if event.from_state else None,
            to_state=JobState(event.to_state) if event.to_state else None,
            message=event.message,
            data=event.data,
        )


class MetricOut(BaseModel):
    attempt: int
    step: int
    loss: float | None
    val_loss: float | None
    samples_per_s: float | None
    step_time_s: float | None
    wall_time: float | None = Field(description="Unix time at which the step finished on rank 0.")
    lr: float | None
    world_size: int | None
    recorded_at: datetime

    @classmethod
    def from_row(cls, metric: Metric) -> "MetricOut":
        return cls(
            attempt=metric.attempt,
            step=metric.step,
            loss=metric.loss,
            val_loss=metric.val_loss,
            samples_per_s=metric.samples_per_s,
            step_time_s=metric.step_time_s,
            wall_time=metric.wall_time,
            lr=metric.lr,
            world_size=metric.world_size,
            recorded_at=metric.recorded_at,
        )


class CheckpointOut(BaseModel):
    attempt: int
    step: int
    uri: str
    world_size: int
    final: bool
    created_at: datetime

    @classmethod
    def from_row(cls, checkpoint: Checkpoint) -> "CheckpointOut":
        return cls(
            attempt=checkpoint.attempt,
            step=checkpoint.step,
            uri=checkpoint.uri,
            world_size=checkpoint.world_size,
            final=checkpoint.final,
            created_at=checkpoint.created_at,
        )


class Page(BaseModel, Generic[Item]):
    items: list[Item]
    total: int = Field(description="Rows matching the query, across all pages.")
    limit: int
    offset: int

    @classmethod
    def convert(cls, page: jobs.Page[Row], item: Callable[[Row], Item]) -> "Page[Item]":
        return cls(items=[item(row) for row in page.items], total=page.total, limit=page.limit, offset=page.offset)


class ReportAck(BaseModel):
    state: JobState = Field(description="The job's state after the report; CANCELLED tells the driver to stop.")
    accepted: bool = Field(description="False when the report came from a superseded attempt or a finished job and was ignored.")


class Health(BaseModel):
    status: str
    database: str
