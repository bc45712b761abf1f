"""The listings a person pages through (GET /v1/jobs with each of its filters, the queue view, the tenants' standing)
read their rows in order from an index: SQLite's plan for every statement they run sorts nothing (no temporary
B-tree) and scans no table whole, so a page costs the same however many jobs and share samples there are
(bench/control_plane_scale.py measures it with 100,000 jobs). Each read is also a fixed, small number of statements,
not one per row."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.orm import Session

from ringmaster.service import jobs, queue_view, tenants
from ringmaster.service.auth import Principal
from ringmaster.service.db import Database, session_scope, upgrade_schema
from ringmaster.service.dispatch_plan import KnownJobs
from ringmaster.service.queue_view import ShareSample
from ringmaster.service.spec import JobSpec
from ringmaster.service.states import JobState

T0 = datetime(2026, 3, 1, tzinfo=UTC)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    url = f"sqlite:///{tmp_path / 'plans.db'}"
    upgrade_schema(url)
    database = Database.connect(url)
    with session_scope(database.sessions) as session:
        for index in range(6):
            tenant = f"team-{index % 2}"
            tenants.ensure_tenant(session, tenant)
            job = jobs.submit_job(
                session, JobSpec(name=f"job-{index}", model="mlp"), principal=Principal(tenant, admin=False)
            )
            job.queue_position = index + 1 if index % 3 else None
        for minute in range(3):
            queue_view.record_shares(session, T0 + timedelta(minutes=minute), [ShareSample("team-0", share=0.5)])
    yield database
    database.dispose()


READS: dict[str, tuple[Callable[[Session], Any], int]] = {  # each read, and how many statements it runs
    "jobs, newest first": (lambda session: jobs.list_jobs(session), 3),  # the count, the page's ids, their rows
    "jobs deep by offset": (lambda session: jobs.list_jobs(session, offset=90_000), 2),
    "jobs in a state": (lambda session: jobs.list_jobs(session, JobState.QUEUED), 3),
    "a tenant's jobs": (lambda session: jobs.list_jobs(session, tenant="team-1", offset=30_000), 2),
    "a tenant's jobs in a state": (lambda session: jobs.list_jobs(session, JobState.FAILED, tenant="team-1"), 2),
    # The two counts, the page's ids (placed, then unplaced where the page goes past them), their rows.
    "the queue": (lambda session: queue_view.queue_page(session, tenant=None, limit=100, offset=0), 5),
    "the queue deep": (lambda session: queue_view.queue_page(session, tenant=None, limit=2, offset=4), 4),
    "a tenant's queue": (lambda session: queue_view.queue_page(session, tenant="team-1", limit=100, offset=0), 5),
    "every tenant's standing": (lambda session: queue_view.tenant_standing(session), 2),
    "a tenant's standing": (lambda session: queue_view.tenant_standing(session, tenant="team-0"), 2),
    "a tenant's usage": (lambda session: tenants.usage(session, "team-1"), 1),
}


def _plans(db: Database, read: Callable[[Session], Any]) -> list[tuple[str, list[str]]]:
    """Each statement the read ran, with SQLite's plan for it (one line per step)."""
    statements: list[tuple[str, Any]] = []

    def record(_connection: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if not statement.startswith("BEGIN"):
            statements.append((statement, parameters))

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        with session_scope(db.sessions) as session:
            read(session)
    finally:
        event.remove(db.engine, "before_cursor_execute", record)
    with db.engine.connect() as connection:
        return [
            (statement, [row[-1] for row in connection.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)])
            for statement, parameters in statements
        ]


@pytest.mark.parametrize("name", READS)
def test_each_listing_reads_its_page_in_index_order_without_a_sort_or_a_whole_table_scan(
    db: Database, name: str
) -> None:
    read, statement_count = READS[name]
    plans = _plans(db, read)
    assert len(plans) == statement_count
    for statement, steps in plans:
        assert not [step for step in steps if "TEMP B-TREE" in step], (statement, steps)
        assert not [step for step in steps if step in ("SCAN jobs", "SCAN tenant_shares")], (statement, steps)


def test_a_dispatcher_pass_reads_each_queued_and_active_job_from_its_index_alone(db: Database) -> None:
    """After the first pass (which reads each job whole once), a pass reads every queued and active job's id and
    attempt from ix_jobs_dispatch alone, never their rows (10,000 queued jobs: their specs beside them)."""
    known = KnownJobs()
    with session_scope(db.sessions) as session:
        known.read(session, 0.0)  # the first pass: every job read whole, every stored place read
    plans = _plans(db, lambda session: known.read(session, 1.0))
    on_jobs = [(statement, steps) for statement, steps in plans if "FROM jobs" in statement]
    assert len(on_jobs) == 2, plans  # the queued jobs, the active ones
    for statement, steps in on_jobs:
        assert steps == ["SEARCH jobs USING COVERING INDEX ix_jobs_dispatch (state=?)"], (statement, steps)
