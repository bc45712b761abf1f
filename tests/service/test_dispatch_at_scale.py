"""Two dispatcher processes on one PostgreSQL schema drain 2,000 queued jobs: each is dispatched exactly once.

The cluster is a stand-in that records every submission in a table of its own (so duplicates from
either process are seen) and finishes each job at once through service.jobs, as its driver would.
"""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from multiprocessing.synchronize import Event as EventType
from typing import Any

import pytest
from sqlalchemy import (
    Column,
    DateTime,
    Engine,
    Integer,
    MetaData,
    Select,
    String,
    Table,
    func,
    insert,
    select,
)

from harness.standin_cluster import StandInCluster, finish_at_once
from ringmaster.service.db import Database, session_scope, upgrade_schema
from ringmaster.service.dispatcher import Dispatcher
from ringmaster.service.driver_handoff import DriverHandoff
from ringmaster.service.models import Attempt, Job, JobEvent, utcnow
from ringmaster.service.settings import Settings
from ringmaster.service.spec import JobSpec
from ringmaster.service.states import TERMINAL, JobState

pytestmark = pytest.mark.postgres

JOB_COUNT = 2000
DISPATCHERS = ("dispatcher-a", "dispatcher-b")
# A stall guard, not a speed target: the test fails only once nothing moved (no job finished, no attempt closed) for
# this long, and prints how long the drain took. The suite's pytest timeout bounds the whole test.
STALL_S = 60

_standin = MetaData()
submissions = Table(
    "standin_submissions",
    _standin,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("submission_id", String(255), nullable=False),  # deliberately not unique: a duplicate must show
    Column("dispatcher", String(64), nullable=False),
    Column("at", DateTime(timezone=True), nullable=False),
)


class RecordingStandIn(StandInCluster):
    """Always has room; records each submission in the shared table and completes the job at once (RUNNING, then
    SUCCEEDED); a Ray job's state is whether either process submitted it."""

    def __init__(self, database: Database, dispatcher: str) -> None:
        super().__init__()
        self.database = database
        self.dispatcher = dispatcher

    def submit(
        self,
        submission_id: str,
        entrypoint: str,
        runtime_env: dict[str, Any],
        metadata: dict[str, str],
        handoff: DriverHandoff,
    ) -> None:
        # One transaction, to keep 2,000 jobs quick: the submission is recorded and both driver reports applied.
        with session_scope(self.database.sessions) as session:
            session.execute(
                insert(submissions).values(submission_id=submission_id, dispatcher=self.dispatcher, at=utcnow())
            )
            finish_at_once(session, submission_id)

    def status(self, submission_id: str) -> str | None:
        with self.database.sessions() as session:
            seen = session.scalar(
                select(func.count()).select_from(submissions).where(submissions.c.submission_id == submission_id)
            )
        return "SUCCEEDED" if seen else None


def _run_dispatcher(url: str, name: str, ready: EventType, go: EventType, stop: EventType) -> None:
    """A dispatcher process: connect, say ready, wait for the common start, loop until stopped."""
    database = Database.connect(url)
    settings = Settings(dispatch_interval_s=0.05, api_url="http://control-plane:8765", storage_uri="/checkpoints")
    dispatcher = Dispatcher(database.sessions, RecordingStandIn(database, name), settings, owner=name)
    ready.set()
    go.wait()
    try:
        dispatcher.run(stop)
    finally:
        database.dispose()


@pytest.fixture
def postgres_url(postgres_admin: Engine) -> Iterator[str]:
    """A fresh PostgreSQL schema at the newest migration, plus the stand-in's submissions table."""
    schema = f"test_{uuid.uuid4().hex[:12]}"
    with postgres_admin.connect() as connection:
        connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    url = postgres_admin.url.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
        hide_password=False
    )
    try:
        upgrade_schema(url)
        yield url
    finally:
        with postgres_admin.connect() as connection:
            connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')


def _bulk_queue(database: Database, count: int) -> list[str]:
    """Insert count QUEUED jobs (with their "submitted" events) in one transaction, oldest first."""
    spec = JobSpec.model_validate({"name": "scale", "model": "mlp", "train": {"steps": 5}}).model_dump(mode="json")
    start = utcnow()
    ids = [uuid.uuid4().hex for _ in range(count)]
    created = [start + timedelta(microseconds=index) for index in range(count)]
    with session_scope(database.sessions) as session:
        session.execute(
            insert(Job),
            [
                {
                    "id": job_id,
                    "name": "scale",
                    "spec": spec,
                    "state": JobState.QUEUED,
                    "priority": 0,
                    "attempt": 0,
                    "failures": 0,
                    "created_at": at,
                    "cancel_requested": False,
                }
                for job_id, at in zip(ids, created)
            ],
        )
        session.execute(
            insert(JobEvent),
            [
                {"job_id": job_id, "at": at, "to_state": JobState.QUEUED, "kind": "transition", "message": "submitted"}
                for job_id, at in zip(ids, created)
            ],
        )
    return ids


def _count(database: Database, query: Select[tuple[int]]) -> int:
    with database.sessions() as session:
        return session.scalar(query) or 0


def test_two_dispatcher_processes_dispatch_2000_jobs_exactly_once(postgres_url: str) -> None:
    database = Database.connect(postgres_url)
    _standin.create_all(database.engine)
    ids = _bulk_queue(database, JOB_COUNT)

    context = multiprocessing.get_context("spawn")
    go, stop = context.Event(), context.Event()
    readies = [context.Event() for _ in DISPATCHERS]
    processes = [
        context.Process(target=_run_dispatcher, args=(postgres_url, name, ready, go, stop), daemon=True)
        for name, ready in zip(DISPATCHERS, readies)
    ]
    finished = select(func.count()).select_from(Job).where(Job.state.in_([s.value for s in TERMINAL]))
    open_attempts = select(func.count()).select_from(Attempt).where(Attempt.ended_at.is_(None))
    try:
        for process in processes:
            process.start()
        for ready, process in zip(readies, processes):
            assert ready.wait(60), f"{process.name} did not start"
        started, all_finished = time.monotonic(), None
        go.set()
        # Done when every job ended and both dispatchers closed every attempt (released its resources).
        progress, moved = (0, 0), time.monotonic()
        while (now := (_count(database, finished), _count(database, open_attempts))) != (JOB_COUNT, 0):
            assert all(process.is_alive() for process in processes), "a dispatcher process died"
            if now != progress:
                progress, moved = now, time.monotonic()
            assert time.monotonic() - moved < STALL_S, (
                f"stalled: {now[0]} of {JOB_COUNT} jobs finished, {now[1]} attempts open, nothing moved for {STALL_S} s"
            )
            if all_finished is None and now[0] == JOB_COUNT:
                all_finished = time.monotonic() - started
            time.sleep(0.2)
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()

    with database.sessions() as session:
        submitted = session.execute(select(submissions.c.submission_id, submissions.c.dispatcher)).all()
        states = Counter(session.scalars(select(Job.state)))
        attempt_numbers = Counter(session.scalars(select(Job.attempt)))
        admissions = Counter(session.scalars(select(JobEvent.job_id).where(JobEvent.to_state == JobState.ADMITTED)))
        closes = Counter(
            session.scalars(select(JobEvent.job_id).where(JobEvent.message == "attempt 1 closed: SUCCEEDED"))
        )
        attempts = Counter(session.scalars(select(Attempt.job_id)))
    database.dispose()

    per_submission = Counter(submission_id for submission_id, _ in submitted)
    assert [sid for sid, times in per_submission.items() if times > 1] == [], "a job was submitted to the cluster twice"
    assert set(per_submission) == {f"ringmaster-{job_id}-1" for job_id in ids}
    assert states == {JobState.SUCCEEDED: JOB_COUNT} and attempt_numbers == {1: JOB_COUNT}
    assert set(admissions) == set(ids) and set(admissions.values()) == {1}, "a job was admitted twice"
    assert set(attempts) == set(ids) and set(attempts.values()) == {1}
    assert set(closes) == set(ids) and set(closes.values()) == {1}, "an attempt was closed twice"
    by_dispatcher = Counter(dispatcher for _, dispatcher in submitted)
    assert set(by_dispatcher) == set(DISPATCHERS) and min(by_dispatcher.values()) > 0, by_dispatcher
    print(
        f"{JOB_COUNT} jobs finished in {all_finished or elapsed:.1f} s, all attempts closed in {elapsed:.1f} s; "
        f"submissions per dispatcher: {dict(by_dispatcher)}"
    )
