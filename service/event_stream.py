"""What a job's event stream sends next: events by id, metric rows by (attempt, step), read in one short transaction
and sent in the order they happened, the job's end last.

The cursor is what the client has seen; it travels as the SSE event id ("<event id>:<attempt>:<step>") so a
client that reconnects with Last-Event-ID resumes exactly where it left off.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from ringmaster.service.jobs import get_job
from ringmaster.service.models import JobEvent, Metric
from ringmaster.service.states import TERMINAL, JobState


@dataclass(frozen=True)
class Cursor:
    event_id: int = 0
    attempt: int = 0
    step: int = -1

    def __str__(self) -> str:
        return f"{self.event_id}:{self.attempt}:{self.step}"

    @classmethod
    def parse(cls, text: str | None) -> Cursor:
        """A Last-Event-ID; anything unreadable starts from the beginning rather than failing the stream."""
        try:
            event_id, attempt, step = (int(part) for part in (text or "").split(":"))
        except ValueError:
            return cls()
        return cls(event_id, attempt, step)


@dataclass(frozen=True)
class StreamItem:
    type: str  # "state", "event" or "metric"
    cursor: Cursor
    data: dict[str, Any]


@dataclass(frozen=True)
class Batch:
    items: list[StreamItem]
    cursor: Cursor
    finished: bool  # the job is terminal and everything up to its end is in items
    more: bool  # a limit was hit: read again at once


def _iso(value: Any) -> str | None:
    return None if value is None else value.isoformat().replace("+00:00", "Z")


def _ends_job(row: JobEvent | Metric) -> bool:
    return isinstance(row, JobEvent) and row.kind == "transition" and row.to_state in TERMINAL


def _happened(row: JobEvent | Metric) -> tuple[bool, Any]:
    """When a row happened, the job's end after everything."""
    return _ends_job(row), row.recorded_at if isinstance(row, Metric) else row.at


def read_batch(session: Session, job_id: str, cursor: Cursor, limit: int = 500) -> Batch:
    """Raises JobNotFound. The job's state is read first, so a terminal state implies its events are visible too."""
    state = JobState(get_job(session, job_id).state)
    events = list(
        session.scalars(
            select(JobEvent)
            .where(JobEvent.job_id == job_id, JobEvent.id > cursor.event_id)
            .order_by(JobEvent.id)
            .limit(limit)
        )
    )
    # A row-value comparison, which both databases answer from the (job_id, attempt, step) index: the OR of the two
    # cases it stands for scanned every step the job ran, at each poll of each stream.
    after = tuple_(Metric.attempt, Metric.step) > tuple_(cursor.attempt, cursor.step)
    metrics = list(
        session.scalars(
            select(Metric).where(Metric.job_id == job_id, after).order_by(Metric.attempt, Metric.step).limit(limit)
        )
    )
    more = len(events) == limit or len(metrics) == limit
    # The job's end is the stream's last item: it waits for every metric row (a read cut short by the limit sends it
    # in a later batch), and sorts after the rows its own final report stored.
    ending = next((index for index, row in enumerate(events) if _ends_job(row)), None)
    if ending is not None and more:
        events = events[:ending]
    # In the order things happened (a checkpoint's event among the steps around it), each kind still in its own order;
    # each item's cursor is what was sent up to it, events and metric rows counted apart.
    items: list[StreamItem] = []
    happened: Iterator[JobEvent | Metric] = heapq.merge(events, metrics, key=_happened)
    for row in happened:
        if isinstance(row, JobEvent):
            cursor = Cursor(row.id, cursor.attempt, cursor.step)
            data = {
                "id": row.id,
                "at": _iso(row.at),
                "kind": row.kind,
                "from_state": row.from_state,
                "to_state": row.to_state,
                "message": row.message,
                "data": row.data,
            }
            items.append(StreamItem("state" if row.kind == "transition" else "event", cursor, data))
        else:
            cursor = Cursor(cursor.event_id, row.attempt, row.step)
            data = {
                field: getattr(row, field)
                for field in (
                    "attempt",
                    "step",
                    "loss",
                    "val_loss",
                    "samples_per_s",
                    "step_time_s",
                    "wall_time",
                    "lr",
                    "grad_norm",
                    "world_size",
                    "user_metrics",
                )
            }
            data["recorded_at"] = _iso(row.recorded_at)
            items.append(StreamItem("metric", cursor, data))
    return Batch(items, cursor, finished=state in TERMINAL and not more, more=more)
