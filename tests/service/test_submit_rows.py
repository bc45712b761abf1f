"""service.jobs.submit_job writes its rows with plain INSERTs: the rows it leaves, and the Job it hands back."""

from __future__ import annotations

from sqlalchemy import event, inspect, text

from ringmaster.service import jobs
from ringmaster.service.db import Database, session_scope
from ringmaster.service.models import Job
from ringmaster.service.spec import JobSpec
from ringmaster.service.states import JobState

SPEC = {"name": "rows", "model": "mlp", "workers": {"min": 1, "max": 2}, "train": {"steps": 10}}


def _rows(db: Database, job_id: str) -> tuple[dict, list[dict]]:
    with db.engine.connect() as connection:
        job = connection.execute(text("SELECT * FROM jobs WHERE id = :id"), {"id": job_id}).mappings().one()
        # data IS NULL tells SQL NULL apart from a stored JSON null.
        events = (
            connection.execute(
                text(
                    "SELECT kind, from_state, to_state, message, data IS NULL AS no_data, at "
                    "FROM job_events WHERE job_id = :id ORDER BY id"
                ),
                {"id": job_id},
            )
            .mappings()
            .all()
        )
    return dict(job), [dict(row) for row in events]


def test_submit_writes_the_job_and_its_submitted_event(db: Database) -> None:
    with session_scope(db.sessions) as session:
        job_id = jobs.submit_job(session, JobSpec.model_validate({**SPEC, "priority": 3})).id
    job, events = _rows(db, job_id)
    assert (job["name"], job["state"], job["priority"], job["attempt"], job["failures"]) == ("rows", "QUEUED", 3, 0, 0)
    assert job["tenant"] == "default" and not job["cancel_requested"]
    assert all(
        job[column] is None
        for column in (
            "admitted_at",
            "started_at",
            "finished_at",
            "error",
            "submission_id",
            "lease_owner",
            "lease_expires_at",
            "waiting_reason",
        )
    )
    assert job["created_at"] is not None
    assert [(e["kind"], e["from_state"], e["to_state"], e["message"], e["no_data"]) for e in events] == [
        ("transition", None, "QUEUED", "submitted", True)
    ]


def test_strategy_auto_adds_the_plan_event_with_its_data(db: Database) -> None:
    with session_scope(db.sessions) as session:
        job_id = jobs.submit_job(session, JobSpec.model_validate({**SPEC, "strategy": "auto"})).id
    job, events = _rows(db, job_id)
    assert [(e["kind"], e["no_data"]) for e in events] == [("transition", True), ("plan", False)]
    assert events[0]["at"] == events[1]["at"] == job["created_at"]
    with session_scope(db.sessions) as session:
        plan = jobs.list_events(session, job_id).items[1]
        assert plan.data is not None and plan.data["requested"] == "auto"
        assert session.get(Job, job_id).spec["strategy"] == plan.data["strategy"] != "auto"  # stored as resolved


def test_the_returned_job_is_loaded_and_held_by_the_session(db: Database) -> None:
    queries: list[str] = []
    event.listen(db.engine, "before_cursor_execute", lambda *args: queries.append(args[2]))
    with session_scope(db.sessions) as session:
        job = jobs.submit_job(session, JobSpec.model_validate(SPEC))
        state = inspect(job)
        assert state.persistent and not state.unloaded and not state.expired_attributes
        written = len(queries)
        assert (job.state, job.waiting_reason, job.admitted_at, job.submission_id) == (
            JobState.QUEUED,
            None,
            None,
            None,
        )
        assert session.get(Job, job.id) is job
        assert len(queries) == written  # reading it back asked the database nothing
        job.priority = 7  # a change to it is flushed like any loaded row's
    with session_scope(db.sessions) as session:
        assert session.get(Job, job.id).priority == 7
