"""Job lifecycle rules in service.jobs: one event per transition, timestamps, attempts and failure counting."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from ringmaster.service.db import Database, session_scope
from ringmaster.service.errors import JobConflict
from ringmaster.service.jobs import (
    apply_driver_report,
    attempts_to_close,
    close_attempt,
    get_job,
    list_events,
    mark_admitted,
    requeue,
    submit_job,
    transition,
)
from ringmaster.service.models import Attempt, Job, JobEvent
from ringmaster.service.reports import DriverReport
from ringmaster.service.spec import JobSpec
from ringmaster.service.states import IllegalTransition, JobState


def _submit(db: Database, max_failures: int = 3) -> str:
    with session_scope(db.sessions) as session:
        return submit_job(session, JobSpec(name="job", model="mlp", max_failures=max_failures)).id


def _admit(db: Database, job_id: str, number: int) -> None:
    with session_scope(db.sessions) as session:
        mark_admitted(session, get_job(session, job_id), number, f"ringmaster-{job_id}-{number}", f"pg-{number}", 2)


def _events(db: Database, job_id: str) -> list[tuple[str | None, str | None, str]]:
    with session_scope(db.sessions) as session:
        return [(e.from_state, e.to_state, e.kind) for e in list_events(session, job_id).items]


def test_submit_records_the_queued_event_with_the_job(db: Database) -> None:
    job_id = _submit(db)
    assert _events(db, job_id) == [(None, "QUEUED", "transition")]


def test_transition_stamps_times_and_writes_one_event_each(db: Database) -> None:
    job_id = _submit(db)
    _admit(db, job_id, 1)
    with session_scope(db.sessions) as session:
        job = transition(session, get_job(session, job_id), JobState.RUNNING, "driver up")
        assert job.started_at is not None and job.finished_at is None
        job = transition(session, job, JobState.FAILED, "boom")
        assert (job.state, job.error) == (JobState.FAILED, "boom")
        assert job.admitted_at is not None and job.started_at is not None and job.finished_at is not None
        assert job.admitted_at <= job.started_at <= job.finished_at
    assert _events(db, job_id)[1:] == [
        ("QUEUED", "ADMITTED", "transition"),
        ("ADMITTED", "RUNNING", "transition"),
        ("RUNNING", "FAILED", "transition"),
    ]


def test_illegal_transition_raises_and_writes_nothing(db: Database) -> None:
    job_id = _submit(db)
    with pytest.raises(IllegalTransition), session_scope(db.sessions) as session:
        transition(session, get_job(session, job_id), JobState.SUCCEEDED, "too early")
    with session_scope(db.sessions) as session:
        assert get_job(session, job_id).state == JobState.QUEUED
        assert session.scalar(select(func.count()).select_from(JobEvent)) == 1


def test_mark_admitted_records_the_attempt_and_clears_the_lease(db: Database) -> None:
    job_id = _submit(db)
    with session_scope(db.sessions) as session:
        get_job(session, job_id).lease_owner = "d1"
    _admit(db, job_id, 1)
    with session_scope(db.sessions) as session:
        job = get_job(session, job_id)
        assert (job.state, job.attempt, job.submission_id, job.lease_owner) == (
            "ADMITTED",
            1,
            f"ringmaster-{job_id}-1",
            None,
        )
        [attempt] = session.scalars(select(Attempt)).all()
        assert (attempt.number, attempt.placement_group, attempt.world_size, attempt.ended_at) == (1, "pg-1", 2, None)


def test_mark_admitted_twice_is_a_conflict(db: Database) -> None:
    job_id = _submit(db)
    _admit(db, job_id, 1)
    with pytest.raises(JobConflict):
        _admit(db, job_id, 1)
    with pytest.raises(IllegalTransition):
        _admit(db, job_id, 2)


def test_requeue_counts_failures_and_fails_after_max_failures(db: Database) -> None:
    job_id = _submit(db, max_failures=1)
    _admit(db, job_id, 1)
    with session_scope(db.sessions) as session:
        job = requeue(session, get_job(session, job_id), "driver did not start", failure=True)
        assert (job.state, job.failures) == (JobState.QUEUED, 1)
    _admit(db, job_id, 2)
    with session_scope(db.sessions) as session:
        job = requeue(session, get_job(session, job_id), "driver did not start", failure=True)
        assert (job.state, job.failures) == (JobState.FAILED, 2)
        assert job.error is not None and "driver did not start" in job.error


def test_requeue_without_failure_keeps_the_count(db: Database) -> None:
    job_id = _submit(db, max_failures=0)
    _admit(db, job_id, 1)
    with session_scope(db.sessions) as session:
        job = requeue(session, get_job(session, job_id), "preempted")
        assert (job.state, job.failures) == (JobState.QUEUED, 0)


def test_attempts_to_close_lists_attempts_of_finished_or_requeued_jobs_once(db: Database) -> None:
    live, cancelled, requeued = _submit(db), _submit(db), _submit(db)
    for job_id in (live, cancelled, requeued):
        _admit(db, job_id, 1)
    with session_scope(db.sessions) as session:
        transition(session, get_job(session, cancelled), JobState.CANCELLED, "user")
        requeue(session, get_job(session, requeued), "lost")
    with session_scope(db.sessions) as session:
        closable = attempts_to_close(session)
        assert sorted(a.job_id for a in closable) == sorted([cancelled, requeued])
        for attempt in closable:
            close_attempt(session, attempt, "stopped")
        again = close_attempt(session, closable[0], "stopped twice")
        assert again.outcome == "stopped"
    with session_scope(db.sessions) as session:
        assert attempts_to_close(session) == []
    assert [kind for _, _, kind in _events(db, cancelled)].count("info") == 1


def test_replayed_report_is_applied_once_and_recovery_counts_a_failure(db: Database) -> None:
    job_id = _submit(db)
    _admit(db, job_id, 1)
    reports = [
        DriverReport(seq=1, state="RUNNING", message="training on 2 workers"),
        DriverReport(seq=2, state="RECOVERING", message="lost rank 1", details={"lost_ranks": [1], "world_size": 1}),
        DriverReport(seq=3, state="RUNNING", message="re-formed at 1 worker"),
        DriverReport(seq=4, message="grew to 2 workers", details={"world_size": 2}),
    ]
    for report in reports + reports:  # the driver replays everything after an outage
        with session_scope(db.sessions) as session:
            apply_driver_report(session, job_id, 1, report)
    with session_scope(db.sessions) as session:
        events = [
            (e.to_state, e.kind, e.message)
            for e in session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id))
        ]
        job = session.get(Job, job_id)
        assert job.failures == 1 and job.state == JobState.RUNNING
        recovering = session.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.to_state == "RECOVERING")
        ).one()
        assert recovering.data == {"attempt": 1, "lost_ranks": [1], "world_size": 1}
    assert events[-4:] == [
        ("RUNNING", "transition", "training on 2 workers"),
        ("RECOVERING", "transition", "lost rank 1"),
        ("RUNNING", "transition", "re-formed at 1 worker"),
        (None, "info", "grew to 2 workers"),
    ]


def test_a_recovery_past_max_failures_fails_the_job_and_ends_the_attempt(db: Database) -> None:
    """The control plane is the one count of failures: the driver's RECOVERING report past max_failures fails the
    job, and its answer tells the driver to stop."""
    job_id = _submit(db, max_failures=1)
    _admit(db, job_id, 1)
    answers = []
    for seq, state in enumerate(["RUNNING", "RECOVERING", "RUNNING", "RECOVERING", "RUNNING"], start=1):
        with session_scope(db.sessions) as session:
            answers.append(
                apply_driver_report(session, job_id, 1, DriverReport(seq=seq, state=state, message=f"{state} {seq}"))
            )
    assert [(answer.state, answer.accepted) for answer in answers] == [
        (JobState.RUNNING, True),
        (JobState.RECOVERING, True),
        (JobState.RUNNING, True),
        (JobState.FAILED, False),
        (JobState.FAILED, False),
    ]
    with session_scope(db.sessions) as session:
        job = session.get(Job, job_id)
        assert job.failures == 2 and job.error == "RECOVERING 4; failure 2, max_failures 1"


def test_a_job_started_once_keeps_its_start_through_a_recovery_and_a_later_attempt(db: Database) -> None:
    job_id = _submit(db)
    _admit(db, job_id, 1)
    with session_scope(db.sessions) as session:
        started = transition(session, get_job(session, job_id), JobState.RUNNING, "driver up").started_at
    with session_scope(db.sessions) as session:
        job = transition(session, get_job(session, job_id), JobState.RECOVERING, "lost a worker")
        job = transition(session, job, JobState.RUNNING, "re-formed")
        assert job.started_at == started
        requeue(session, job, "the driver died", failure=True)
    _admit(db, job_id, 2)
    with session_scope(db.sessions) as session:
        job = transition(session, get_job(session, job_id), JobState.RUNNING, "attempt 2 up")
        assert (job.attempt, job.started_at) == (2, started)
        assert job.admitted_at > started
