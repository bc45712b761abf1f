"""Prometheus telemetry of the control plane: counters updated where things happen, gauges read from the database.

service/jobs.py records what happened (a transition, a checkpoint) on the Session with ``record_*``; the
observations are applied only after that transaction commits (a rolled-back transition counts nothing), and
only to the Telemetry attached to the session's engine. Each API app owns a CollectorRegistry and a Telemetry
attached to its own engine, so several apps in one process (tests) never see each other's numbers.

The dispatcher records its scheduling decisions the same way (``record_preemption``, ``record_resize``).

Gauges (queue depth by state, per running job steps/s and loss, each tenant's fair share as the dispatcher last
sampled it) are computed at scrape time by DatabaseCollector: the database is the only state, so every replica reports
the same values.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.core import Metric as PromMetric
from prometheus_client.registry import Collector
from sqlalchemy import Engine, and_, event, func, select
from sqlalchemy.orm import Session

from ringmaster.service import queue_view
from ringmaster.service.db import Database, session_scope
from ringmaster.service.models import Job, JobEvent, Metric
from ringmaster.service.states import JobState

_PENDING = "ringmaster_telemetry"
# Seconds: from one second (a busy loop) to an hour (a cluster that scales up).
RECONCILER_ACTIONS = ("resubmitted", "adopted", "attempt_closed", "failed_unstarted")
RESIZE_DIRECTIONS = ("grow", "shrink")
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class Telemetry:
    """The counters and histograms of one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.transitions = Counter(
            "ringmaster_job_transitions",
            "Job state transitions, by the state entered.",
            ["to_state"],
            registry=registry,
        )
        self.dispatch_latency = Histogram(
            "ringmaster_dispatch_latency_seconds",
            "Time from a job entering the queue (submitted or requeued) to its admission on Ray.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.recoveries = Counter(
            "ringmaster_recoveries", "Transitions to RECOVERING (a worker was lost).", registry=registry
        )
        self.recovery_duration = Histogram(
            "ringmaster_recovery_duration_seconds",
            "Time from RECOVERING back to RUNNING.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.checkpoints = Counter(
            "ringmaster_checkpoints", "Checkpoints reported by drivers (each URI once).", registry=registry
        )
        self.checkpoint_save = Histogram(
            "ringmaster_checkpoint_save_seconds",
            "Seconds from a checkpoint save's start to its commit.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.checkpoint_blocked = Histogram(
            "ringmaster_checkpoint_blocked_seconds",
            "Seconds training waited for a checkpoint save to start (staging).",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.checkpoint_restore = Histogram(
            "ringmaster_checkpoint_restore_seconds",
            "Seconds a job took to load a checkpoint when it started or re-formed.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.reconciler_actions = Counter(
            "ringmaster_reconciler_actions",
            "What the reconciler did: resubmitted a lost attempt, adopted a running "
            "Ray job it had not started, closed an ended attempt, failed a job whose driver never started.",
            ["action"],
            registry=registry,
        )
        self.preemptions = Counter(
            "ringmaster_preemptions",
            "Jobs the dispatcher asked to stop for a job of higher priority or a fairer share, by the stopped job's "
            "tenant.",
            ["tenant"],
            registry=registry,
        )
        self.resizes = Counter(
            "ringmaster_resizes",
            "Running jobs the dispatcher grew into free capacity or shrank to make room, by direction.",
            ["direction"],
            registry=registry,
        )
        for action in RECONCILER_ACTIONS:
            self.reconciler_actions.labels(action=action)
        for direction in RESIZE_DIRECTIONS:
            self.resizes.labels(direction=direction)
        for state in JobState:  # every series exists from the start, at 0
            self.transitions.labels(to_state=state.value)

    def apply(self, observation: Observation) -> None:
        if observation.kind == "transition":
            self.transitions.labels(to_state=observation.label).inc()
            if observation.label == JobState.RECOVERING:
                self.recoveries.inc()
        elif observation.kind == "dispatch_latency":
            self.dispatch_latency.observe(observation.value)
        elif observation.kind == "recovery_duration":
            self.recovery_duration.observe(observation.value)
        elif observation.kind == "checkpoint":
            self.checkpoints.inc(observation.value)
        elif observation.kind == "checkpoint_save":
            self.checkpoint_save.observe(observation.value)
        elif observation.kind == "checkpoint_blocked":
            self.checkpoint_blocked.observe(observation.value)
        elif observation.kind == "checkpoint_restore":
            self.checkpoint_restore.observe(observation.value)
        elif observation.kind == "reconciler_action":
            self.reconciler_actions.labels(action=observation.label).inc()
        elif observation.kind == "preemption":
            self.preemptions.labels(tenant=observation.label).inc()
        elif observation.kind == "resize":
            self.resizes.labels(direction=observation.label).inc()


@dataclass(frozen=True)
class Observation:
    kind: str
    label: str = ""
    value: float = 1.0


_sinks: weakref.WeakKeyDictionary[Engine, list[Telemetry]] = weakref.WeakKeyDictionary()
_sinks_lock = threading.Lock()


def attach(engine: Engine, telemetry: Telemetry) -> Callable[[], None]:
    """Send the committed observations of sessions bound to engine to telemetry; returns the detach function."""
    with _sinks_lock:
        _sinks.setdefault(engine, []).append(telemetry)

    def detach() -> None:
        with _sinks_lock:
            listeners = _sinks.get(engine, [])
            if telemetry in listeners:
                listeners.remove(telemetry)

    return detach


def _pending(session: Session) -> list[Observation]:
    pending: list[Observation] = session.info.setdefault(_PENDING, [])
    return pending


def _seconds(later: datetime, earlier: datetime | None) -> float | None:
    return None if earlier is None else max((later - earlier).total_seconds(), 0.0)


def _last_entered(session: Session, job_id: str, state: JobState) -> datetime | None:
    """When the job last entered state, from its events (the current transition's event is not written yet)."""
    query = select(func.max(JobEvent.at)).where(JobEvent.job_id == job_id, JobEvent.to_state == state)
    entered: datetime | None = session.scalar(query)
    return entered


def record_transition(session: Session, job: Job, current: JobState, target: JobState, now: datetime) -> None:
    """Called by service.jobs.transition before it writes the transition's event."""
    pending = _pending(session)
    pending.append(Observation("transition", target.value))
    if target == JobState.ADMITTED:
        waited = _seconds(now, _last_entered(session, job.id, JobState.QUEUED) or job.created_at)
        if waited is not None:
            pending.append(Observation("dispatch_latency", value=waited))
    elif current == JobState.RECOVERING and target == JobState.RUNNING:
        took = _seconds(now, _last_entered(session, job.id, JobState.RECOVERING))
        if took is not None:
            pending.append(Observation("recovery_duration", value=took))


def record_checkpoints(session: Session, count: int) -> None:
    if count:
        _pending(session).append(Observation("checkpoint", value=float(count)))


def record_checkpoint_timing(
    session: Session, *, save_s: float | None = None, blocked_s: float | None = None, restore_s: float | None = None
) -> None:
    for kind, seconds in (
        ("checkpoint_save", save_s),
        ("checkpoint_blocked", blocked_s),
        ("checkpoint_restore", restore_s),
    ):
        if seconds is not None:
            _pending(session).append(Observation(kind, value=seconds))


def record_reconciler_action(session: Session, action: str) -> None:
    if action not in RECONCILER_ACTIONS:
        raise ValueError(f"unknown reconciler action {action!r}; known: {', '.join(RECONCILER_ACTIONS)}")
    _pending(session).append(Observation("reconciler_action", action))


def record_preemption(session: Session, job: Job) -> None:
    """Called when the dispatcher asks a job's driver to stop for another job; counted once the transaction commits."""
    _pending(session).append(Observation("preemption", job.tenant))


def record_resize(session: Session, from_workers: int, to_workers: int) -> None:
    """Called when the dispatcher changes a running job's size; a size left as it was counts nothing."""
    if to_workers != from_workers:
        _pending(session).append(Observation("resize", "grow" if to_workers > from_workers else "shrink"))


@event.listens_for(Session, "after_commit")
def _after_commit(session: Session) -> None:
    pending = session.info.pop(_PENDING, None)
    if not pending or not isinstance(session.bind, Engine):
        return
    with _sinks_lock:
        listeners = list(_sinks.get(session.bind, []))
    for telemetry in listeners:
        for observation in pending:
            telemetry.apply(observation)


@event.listens_for(Session, "after_rollback")
def _after_rollback(session: Session) -> None:
    session.info.pop(_PENDING, None)


class DatabaseCollector(Collector):
    """Gauges read from the database at each scrape: queue depth by state, the latest metrics of running jobs, and
    each tenant's fair share from the dispatcher's latest sample."""

    def __init__(self, database: Callable[[], Database | None]) -> None:
        self._database = database

    def describe(self) -> list[PromMetric]:
        return []  # computed at scrape time; nothing to check at registration

    def collect(self) -> Iterator[PromMetric]:
        database = self._database()
        if database is None:  # before the app's startup
            return
        jobs = GaugeMetricFamily(
            "ringmaster_jobs", "Jobs in each state, by tenant (QUEUED is the queue depth).", labels=["state", "tenant"]
        )
        steps = GaugeMetricFamily(
            "ringmaster_job_steps_per_second",
            "Steps per second of a running job (1 / its latest step time).",
            labels=["job_id", "name"],
        )
        samples = GaugeMetricFamily(
            "ringmaster_job_samples_per_second",
            "Samples per second of a running job at its latest step.",
            labels=["job_id", "name"],
        )
        loss = GaugeMetricFamily(
            "ringmaster_job_loss", "Training loss of a running job at its latest step.", labels=["job_id", "name"]
        )
        step = GaugeMetricFamily(
            "ringmaster_job_step",
            "Latest step a running job reported in its current attempt.",
            labels=["job_id", "name"],
        )
        queue_length = GaugeMetricFamily(
            "ringmaster_queue_length", "Jobs waiting in the queue (QUEUED), every tenant together."
        )
        share = GaugeMetricFamily(
            "ringmaster_tenant_share",
            "A tenant's dominant share of the cluster (0 to 1) at the dispatcher's latest sample.",
            labels=["tenant"],
        )
        decayed_share = GaugeMetricFamily(
            "ringmaster_tenant_decayed_share",
            "A tenant's share over the recent past, which fair share orders by, at the dispatcher's latest sample.",
            labels=["tenant"],
        )
        entitled_share = GaugeMetricFamily(
            "ringmaster_tenant_entitled_share",
            "A tenant's weight over the weights of the tenants with work, at the dispatcher's latest sample.",
            labels=["tenant"],
        )
        with session_scope(database.sessions) as session:
            for standing in queue_view.tenant_standing(session):
                share.add_metric([standing.name], standing.share)
                decayed_share.add_metric([standing.name], standing.decayed_share)
                entitled_share.add_metric([standing.name], standing.entitled_share)
            counts: dict[tuple[str, str], int] = {}
            for state, tenant, count in session.execute(
                select(Job.state, Job.tenant, func.count()).group_by(Job.state, Job.tenant)
            ):
                counts[(state, tenant)] = count
            for row in _latest_running_metrics(session):
                labels = [row.job_id, row.name]
                step.add_metric(labels, row.step)
                if row.step_time_s:
                    steps.add_metric(labels, 1.0 / row.step_time_s)
                if row.samples_per_s is not None:
                    samples.add_metric(labels, row.samples_per_s)
                if row.loss is not None:
                    loss.add_metric(labels, row.loss)
        for tenant in sorted({tenant for _, tenant in counts}) or ["default"]:
            for state in JobState:  # every state of every tenant with jobs, 0 included, so a queue that empties reads 0
                jobs.add_metric([state.value, tenant], counts.get((state.value, tenant), 0))
        queue_length.add_metric([], sum(count for (state, _), count in counts.items() if state == JobState.QUEUED))
        yield from (jobs, queue_length, share, decayed_share, entitled_share, step, steps, samples, loss)


def _latest_running_metrics(session: Session) -> Any:
    """The metric row with the highest step of each RUNNING job's current attempt."""
    latest = (
        select(Metric.job_id, func.max(Metric.step).label("step"))
        .join(Job, and_(Job.id == Metric.job_id, Job.attempt == Metric.attempt))
        .where(Job.state == JobState.RUNNING)
        .group_by(Metric.job_id)
        .subquery()
    )
    query = (
        select(Job.id.label("job_id"), Job.name, Metric.step, Metric.step_time_s, Metric.samples_per_s, Metric.loss)
        .join(latest, latest.c.job_id == Job.id)
        .join(Metric, and_(Metric.job_id == Job.id, Metric.attempt == Job.attempt, Metric.step == latest.c.step))
        .order_by(Job.id)
    )
    return session.execute(query)
