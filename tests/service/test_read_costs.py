"""What the control plane reads again and again costs the same few row reads however many steps a job has run (its
progress at every `GET /v1/jobs/{id}`, the event stream's next batch at every poll, the MLflow export's next rows at
every pass) and however many jobs have run before (the open attempts, at every dispatcher pass; the newest runtime
envs, at every warm-pool upkeep). Counted in SQLite's
virtual-machine instructions, which each row read adds to and which wall time on a shared machine would blur."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, insert, select

from ringmaster.service.db import Database, session_scope, upgrade_schema
from ringmaster.service.dispatcher import newest_jobs_that_ran_in_an_env_of_their_own
from ringmaster.service.event_stream import Cursor, read_batch
from ringmaster.service.jobs import (
    attempts_to_close,
    cancel_job,
    close_attempt,
    get_job,
    job_progress,
    mark_admitted,
    submit_job,
)
from ringmaster.service.mlflow_export import metric_rows_after
from ringmaster.service.models import Attempt, Job, Metric, utcnow
from ringmaster.service.spec import JobSpec, RuntimeEnvSpec
from ringmaster.service.states import JobState

FEW, MANY = 200, 20_000
VALIDATED_STEP = 100


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    url = f"sqlite:///{tmp_path / 'reads.db'}"
    upgrade_schema(url)
    database = Database.connect(url)
    yield database
    database.dispose()


def _submit(db: Database) -> str:
    with session_scope(db.sessions) as session:
        return submit_job(session, JobSpec(name="job", model="mlp")).id


def _grow(db: Database, job_id: str, attempt: int, steps: int) -> None:
    """Rows of `attempt` up to `steps`; one validated step."""
    with session_scope(db.sessions) as session:
        have = session.scalar(
            select(func.count()).select_from(Metric).where(Metric.job_id == job_id, Metric.attempt == attempt)
        )
        session.execute(
            insert(Metric),
            [
                {
                    "job_id": job_id,
                    "attempt": attempt,
                    "step": step,
                    "loss": 1.0 / step,
                    "val_loss": 2.0 if step == VALIDATED_STEP else None,
                    "recorded_at": utcnow(),
                }
                for step in range(have + 1, steps + 1)
            ],
        )


def _instructions(db: Database, read: Callable[[Any], Any]) -> tuple[int, Any]:
    with session_scope(db.sessions) as session:
        ticks: list[int] = []
        session.connection().connection.dbapi_connection.set_progress_handler(lambda: ticks.append(1), 10)
        result = read(session)
        return len(ticks), result


def test_a_jobs_progress_finds_its_newest_validation_without_reading_every_step(db: Database) -> None:
    # Before the validated rows had an index of their own, this scan took 95 ms per request at 300,000 steps.
    job_id = _submit(db)
    counted = {}
    for steps in (FEW, MANY):
        _grow(db, job_id, 1, steps)
        counted[steps], progress = _instructions(db, lambda session: job_progress(session, get_job(session, job_id)))
        assert (progress.step, progress.val_step, progress.val_loss) == (steps, VALIDATED_STEP, 2.0)
    assert counted[MANY] < 2 * counted[FEW], counted


def test_the_streams_next_batch_starts_at_its_cursor_in_any_attempt_without_reading_the_steps_before(
    db: Database,
) -> None:
    # Before, the cursor's OR of two cases read the job's rows from its first step: 39 ms per poll at 300,000 steps.
    job_id = _submit(db)
    counted = {}
    for steps in (FEW, MANY):
        _grow(db, job_id, 1, steps)
        cursor = Cursor(event_id=10**9, attempt=1, step=steps - 3)
        counted[steps], batch = _instructions(db, lambda session, cursor=cursor: read_batch(session, job_id, cursor))
        assert [(item.data["attempt"], item.data["step"]) for item in batch.items] == [
            (1, steps - 2),
            (1, steps - 1),
            (1, steps),
        ]
    assert counted[MANY] < 2 * counted[FEW], counted

    # A later attempt's rows follow the cursor's attempt: its own steps start again from 1.
    _grow(db, job_id, 2, 2)
    with session_scope(db.sessions) as session:
        batch = read_batch(session, job_id, Cursor(event_id=10**9, attempt=1, step=MANY - 1))
    assert [(item.data["attempt"], item.data["step"]) for item in batch.items] == [(1, MANY), (2, 1), (2, 2)]


def test_the_mlflow_exports_next_rows_after_its_cursor_are_read_without_the_rows_before(db: Database) -> None:
    # Before the (job_id, id) index, 29 ms per job and pass at 300,000 steps; the exporter passes every 2 s.
    job_id = _submit(db)
    counted = {}
    for steps in (FEW, MANY):
        _grow(db, job_id, 1, steps)
        with db.sessions() as session:
            cursor = session.scalar(select(Metric.id).where(Metric.job_id == job_id, Metric.step == steps - 2))
        counted[steps], rows = _instructions(
            db, lambda session, cursor=cursor: metric_rows_after(session, job_id, cursor)
        )
        assert [row.step for row in rows] == [steps - 1, steps]
    assert counted[MANY] < 2 * counted[FEW], counted


def _finished_jobs(db: Database, count: int, first_created_at: datetime) -> list[str]:
    """`count` SUCCEEDED jobs with one closed attempt each, created a second apart from `first_created_at`."""
    ids = [uuid.uuid4().hex for _ in range(count)]
    with session_scope(db.sessions) as session:
        now = utcnow()
        session.execute(
            insert(Job),
            [
                {
                    "id": job_id,
                    "name": "done",
                    "spec": {"name": "done", "model": "mlp"},
                    "state": JobState.SUCCEEDED.value,
                    "attempt": 1,
                    "updated_at": now,
                    "created_at": first_created_at + timedelta(seconds=index),
                }
                for index, job_id in enumerate(ids)
            ],
        )
        session.execute(
            insert(Attempt),
            [
                {
                    "job_id": job_id,
                    "number": 1,
                    "submission_id": f"ringmaster-{job_id}-1",
                    "started_at": now,
                    "ended_at": now,
                }
                for job_id in ids
            ],
        )
    return ids


def test_a_dispatcher_pass_finds_the_open_attempts_without_reading_every_attempt_ever_run(db: Database) -> None:
    # Before the open attempts had an index of their own, 18 ms per pass (two a second) after 100,000 jobs.
    closed_job_ids: list[str] = []
    counted = {}
    for jobs_run in (FEW, MANY):
        closed_job_ids += _finished_jobs(db, jobs_run - len(closed_job_ids), utcnow() - timedelta(days=1))
        open_job_id = _submit(db)
        with session_scope(db.sessions) as session:
            mark_admitted(session, get_job(session, open_job_id), 1, f"ringmaster-{open_job_id}-1", "pg-1", 1)
            cancel_job(session, open_job_id)  # its attempt stays open until a dispatcher closes it
        counted[jobs_run], to_close = _instructions(db, attempts_to_close)
        assert [attempt.job_id for attempt in to_close][-1] == open_job_id
        with session_scope(db.sessions) as session:
            close_attempt(session, to_close[-1], "cancelled")
    assert counted[MANY] < 2 * counted[FEW], counted


def test_the_warm_pools_newest_runtime_envs_are_read_from_the_newest_jobs_without_sorting_every_job_ever_run(
    db: Database,
) -> None:
    # Before, SQLite searched the queue index for every finished job and sorted them all: 12 ms per upkeep (every 2 s)
    # after 100,000 jobs.
    counted = {}
    jobs_run = 0
    for jobs_before in (FEW, MANY):
        _finished_jobs(db, jobs_before - jobs_run, utcnow() - timedelta(days=1))
        jobs_run = jobs_before
        newest = {}
        for name, state in [
            ("ran", JobState.SUCCEEDED),
            ("plain", JobState.SUCCEEDED),
            ("broken", JobState.FAILED),
            ("running", JobState.RUNNING),
            ("queued", JobState.QUEUED),
        ]:
            spec = JobSpec(name=name, model="mlp")
            if name != "plain":
                spec = spec.model_copy(
                    update={"runtime_env": RuntimeEnvSpec(env_vars={"PROJECT": f"{name}-{jobs_before}"})}
                )
            with session_scope(db.sessions) as session:
                newest[name] = submit_job(session, spec).id
                session.flush()
                session.get(Job, newest[name]).state = state.value
        counted[jobs_before], found = _instructions(db, newest_jobs_that_ran_in_an_env_of_their_own)
        # Newest first; only jobs with an env of their own that ran in it (the FAILED one may never have started).
        assert [spec.runtime_env.env_vars["PROJECT"] for _, spec in found][:2] == [
            f"running-{jobs_before}",
            f"ran-{jobs_before}",
        ]
    assert counted[MANY] < 2 * counted[FEW], counted
