"""Engine, sessions and schema upgrades for SQLite (embedded) and PostgreSQL (production).

On SQLite every transaction starts with ``BEGIN IMMEDIATE``: SQLite has no row locks, and a
deferred transaction that reads and then writes fails with SQLITE_BUSY (which busy_timeout
cannot wait out) as soon as another writer committed in between. Taking the write lock up front
serializes writers, waiting up to busy_timeout, so every read-modify-write in service/jobs.py
and the queue claim are atomic — the role row locks (``FOR UPDATE``) play on PostgreSQL. The
price: keep sessions short, never hold one open across a call to Ray, and never open a second
session in a thread that already has one open (it waits out the timeouts, then "database is locked").

The transactions of one engine also queue on a lock before ``BEGIN IMMEDIATE``, held until the
connection goes back to the pool: SQLite's own busy handler polls with sleeps growing to 100 ms, so
under contention a writer would sleep on long after the database came free (that was the p99 of
submissions). Other engines and processes still meet at busy_timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event, make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 5000
_HOLDS_WRITE_LOCK = "ringmaster_holds_write_lock"
# Any constant shared by all replicas: serializes concurrent schema upgrades on PostgreSQL.
_MIGRATION_LOCK_ID = 0x52494E47
# Connections kept open between requests: SQLAlchemy's 5 (of its 15 at most) made each of a burst of 8 concurrent
# requests open and close a connection of its own. The ceiling stays at 15.
_POOL = {"pool_size": 10, "max_overflow": 5}


def make_engine(url: str) -> Engine:
    """An engine with the per-dialect settings the control plane relies on."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True, **_POOL)
    database = parsed.database or ""
    file_path = database not in ("", ":memory:") and not database.startswith("file:")
    if file_path:
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    # No pool_pre_ping: a SQLite connection is a file handle, which nothing on the other end can drop; the ping was a
    # query on every checkout. An in-memory database keeps SQLAlchemy's own pool, which takes no size.
    engine = create_engine(parsed, connect_args={"check_same_thread": False}, **(_POOL if file_path else {}))

    @event.listens_for(engine, "connect")
    def _configure(dbapi_connection: Any, _record: Any) -> None:
        # Hand transaction control to SQLAlchemy so that _begin_immediate below is what starts it.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    write_lock = threading.Lock()  # a plain Lock: FastAPI may close a session on another thread than opened it

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection: Connection) -> None:
        info = connection.connection.info  # the pooled connection's, which "checkin" below sees again
        # On a timeout (a thread opening a second session while holding one) BEGIN IMMEDIATE still decides, as before.
        if not info.get(_HOLDS_WRITE_LOCK) and write_lock.acquire(timeout=SQLITE_BUSY_TIMEOUT_MS / 1000):
            info[_HOLDS_WRITE_LOCK] = True
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    def _release(info: MutableMapping[Any, Any]) -> None:
        if info.pop(_HOLDS_WRITE_LOCK, False):
            write_lock.release()

    # At checkin, after the commit or rollback (even of an invalidated connection): released any earlier, the next
    # writer would find SQLite still busy and sleep.
    event.listen(engine.pool, "checkin", lambda _dbapi, record: _release(record.info))
    return engine


@dataclass(frozen=True)
class Database:
    """The engine and the session factory built on it; one per process."""

    engine: Engine
    sessions: sessionmaker[Session]

    @classmethod
    def connect(cls, url: str) -> Database:
        engine = make_engine(url)
        # expire_on_commit=False: rows returned from a finished transaction (claim_next) stay readable.
        return cls(engine, sessionmaker(engine, expire_on_commit=False))

    def dispose(self) -> None:
        self.engine.dispose()


@contextmanager
def session_scope(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """One transaction: commit when the block ends normally, roll back when it raises."""
    with sessions() as session, session.begin():
        yield session


def alembic_config(connection: Connection) -> Config:
    """Alembic configuration without an alembic.ini: the scripts ship inside the package."""
    config = Config()
    config.set_main_option("script_location", str(resources.files("ringmaster.service") / "migrations"))
    config.attributes["connection"] = connection
    return config


def upgrade_schema(url: str) -> None:
    """Bring the database to the newest schema; safe to call from several replicas at once."""
    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK_ID})")
            command.upgrade(alembic_config(connection), "head")
    finally:
        engine.dispose()
