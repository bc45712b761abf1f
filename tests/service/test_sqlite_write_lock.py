"""SQLite writers of one process queue on a lock before BEGIN IMMEDIATE (service/db.py): every way a transaction ends
hands the lock on at once, and concurrent writers neither fail nor lose updates."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import text

from ringmaster.service.db import SQLITE_BUSY_TIMEOUT_MS, Database, session_scope, upgrade_schema

# Far below the busy timeout: a writer that found the lock still held would wait all of it.
PROMPT_S = SQLITE_BUSY_TIMEOUT_MS / 1000 / 5


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[Database]:
    url = f"sqlite:///{tmp_path}/writers.db"
    upgrade_schema(url)
    database = Database.connect(url)
    with database.engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE counter (id INTEGER PRIMARY KEY, value INTEGER NOT NULL)")
        connection.exec_driver_sql("INSERT INTO counter VALUES (1, 0)")
    yield database
    database.dispose()


def _seconds_to_write_from_another_thread(database: Database) -> float:
    def write() -> float:
        started = time.monotonic()
        with session_scope(database.sessions) as session:
            session.execute(text("UPDATE counter SET value = value + 1"))
        return time.monotonic() - started

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(write).result(timeout=4 * SQLITE_BUSY_TIMEOUT_MS / 1000)


def test_concurrent_read_modify_writes_lose_nothing(sqlite_db: Database) -> None:
    def increment_many() -> None:
        for _ in range(25):
            with session_scope(sqlite_db.sessions) as session:
                value = session.execute(text("SELECT value FROM counter")).scalar_one()
                session.execute(text("UPDATE counter SET value = :v"), {"v": value + 1})

    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(increment_many) for _ in range(8)]:
            future.result()
    with session_scope(sqlite_db.sessions) as session:
        assert session.execute(text("SELECT value FROM counter")).scalar_one() == 200


def test_a_rolled_back_transaction_hands_the_lock_on_at_once(sqlite_db: Database) -> None:
    with pytest.raises(RuntimeError), session_scope(sqlite_db.sessions) as session:
        session.execute(text("UPDATE counter SET value = 99"))
        raise RuntimeError("rolled back")
    assert _seconds_to_write_from_another_thread(sqlite_db) < PROMPT_S


def test_a_read_only_session_hands_the_lock_on_at_once(sqlite_db: Database) -> None:
    with sqlite_db.sessions() as session:
        session.execute(text("SELECT value FROM counter")).scalar_one()
    assert _seconds_to_write_from_another_thread(sqlite_db) < PROMPT_S


def test_an_invalidated_connection_hands_the_lock_on_at_once(sqlite_db: Database) -> None:
    with sqlite_db.sessions() as session:
        session.execute(text("SELECT value FROM counter")).scalar_one()
        session.connection().invalidate()
    assert _seconds_to_write_from_another_thread(sqlite_db) < PROMPT_S


def test_a_session_closed_on_another_thread_hands_the_lock_on(sqlite_db: Database) -> None:
    """FastAPI may run a generator dependency's exit on another thread of its pool than its entry."""
    session = sqlite_db.sessions()
    session.begin()
    session.execute(text("UPDATE counter SET value = 7"))
    closer = threading.Thread(target=lambda: (session.commit(), session.close()))
    closer.start()
    closer.join()
    assert _seconds_to_write_from_another_thread(sqlite_db) < PROMPT_S
    with session_scope(sqlite_db.sessions) as check:
        assert check.execute(text("SELECT value FROM counter")).scalar_one() == 8


def test_a_connection_running_several_transactions_does_not_wait_on_itself(sqlite_db: Database) -> None:
    started = time.monotonic()
    with sqlite_db.engine.connect() as connection:
        for _ in range(3):
            with connection.begin():
                connection.execute(text("UPDATE counter SET value = value + 1"))
    assert time.monotonic() - started < PROMPT_S
    assert _seconds_to_write_from_another_thread(sqlite_db) < PROMPT_S
