"""Engine behaviour the control plane relies on: UTC timestamps everywhere, SQLite tuned for concurrent use."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

from ringmaster.service.db import Database, make_engine, session_scope
from ringmaster.service.jobs import submit_job
from ringmaster.service.models import Job
from ringmaster.service.spec import JobSpec


def test_timestamps_come_back_timezone_aware_utc(db: Database) -> None:
    local = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=2)))
    with session_scope(db.sessions) as session:
        job = submit_job(session, JobSpec(name="clock", model="mlp"))
        job.created_at = local
    with session_scope(db.sessions) as session:
        stored = session.get(Job, job.id)
        assert stored is not None
        assert stored.created_at == local and stored.created_at.tzinfo == UTC


def test_sqlite_engine_uses_wal_and_creates_its_directory(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "ringmaster.db"
    engine = make_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert path.exists()
    finally:
        engine.dispose()
