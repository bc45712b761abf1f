"""The API's token cache: one query per token per TTL, revocations on this replica at once, elsewhere within the TTL."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event
from sqlalchemy.orm import ORMExecuteState, sessionmaker

from ringmaster.api.app import create_app
from ringmaster.service import auth
from ringmaster.service.db import Database, session_scope
from ringmaster.service.settings import Settings


class _Clock:
    """An injected clock: the test moves time, nothing waits for it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def issued(db: Database) -> auth.IssuedToken:
    with session_scope(db.sessions) as session:
        return auth.create_token(session, "team-a")


def _revoke_from_another_replica(db_url: str, token_id: int) -> None:
    other = Database.connect(db_url)
    try:
        with session_scope(other.sessions) as session:
            auth.revoke_token(session, token_id)
    finally:
        other.dispose()


def test_the_api_queries_a_token_once_per_ttl(db_url: str, tmp_path: Path) -> None:
    with TestClient(create_app(Settings(database_url=db_url, data_dir=tmp_path))) as client:
        database: Database = client.app.state.db  # type: ignore[attr-defined]
        with session_scope(database.sessions) as session:
            secret = auth.create_token(session, "team-a").secret
        lookups: list[str] = []

        @event.listens_for(database.engine, "before_cursor_execute")
        def _count(_conn: object, _cursor: object, statement: str, *_: object) -> None:
            if "FROM api_tokens" in statement:
                lookups.append(statement)

        for _ in range(5):
            assert client.get("/v1/jobs", headers={"Authorization": f"Bearer {secret}"}).status_code == 200
        assert len(lookups) == 1
        assert client.get("/v1/jobs", headers={"Authorization": "Bearer rm_unknown"}).status_code == 401
        assert client.get("/v1/jobs", headers={"Authorization": "Bearer rm_unknown"}).status_code == 401
        assert len(lookups) == 3, "an unknown token is never cached"


def test_a_revocation_on_another_replica_takes_effect_within_the_ttl(
    db: Database, db_url: str, issued: auth.IssuedToken
) -> None:
    clock = _Clock()
    cache = auth.TokenCache(ttl_s=30.0, clock=clock)
    assert cache.load(db.sessions, issued.secret) == auth.Principal("team-a", False, issued.row.id)
    _revoke_from_another_replica(db_url, issued.row.id)
    clock.now += 29.9
    assert cache.get(issued.secret) is not None, "this replica has not heard of it yet"
    clock.now += 0.2
    assert cache.get(issued.secret) is None
    with pytest.raises(auth.Unauthorized, match="was revoked"):
        cache.load(db.sessions, issued.secret)


def test_a_revocation_committed_on_this_replica_clears_its_cache_at_once(
    db: Database, issued: auth.IssuedToken
) -> None:
    cache = auth.token_cache(db.sessions)
    assert auth.token_cache(db.sessions) is cache, "one cache per database"
    cache.load(db.sessions, issued.secret)
    with pytest.raises(RuntimeError), session_scope(db.sessions) as session:
        auth.revoke_token(session, issued.row.id)
        raise RuntimeError("rolled back")
    assert cache.get(issued.secret) is not None, "a rolled-back revocation revokes nothing"
    with session_scope(db.sessions) as session:
        auth.revoke_token(session, issued.row.id)
    assert cache.get(issued.secret) is None


def test_a_lookup_that_races_a_revocation_caches_nothing(db: Database, issued: auth.IssuedToken) -> None:
    cache = auth.TokenCache()

    @event.listens_for(db.sessions, "do_orm_execute")
    def _revoked_meanwhile(_state: ORMExecuteState) -> None:
        cache.forget([issued.row.id])  # as if a revocation committed while the row was being read

    assert cache.load(db.sessions, issued.secret).tenant == "team-a"
    assert cache.get(issued.secret) is None


def test_the_cache_drops_expired_entries_when_full(db: Database) -> None:
    with session_scope(db.sessions) as session:
        secrets = [auth.create_token(session, "team-a").secret for _ in range(3)]
    clock = _Clock()
    cache = auth.TokenCache(ttl_s=30.0, max_entries=2, clock=clock)
    cache.load(db.sessions, secrets[0])
    cache.load(db.sessions, secrets[1])
    clock.now += 31.0
    cache.load(db.sessions, secrets[2])
    assert len(cache._entries) == 1 and cache.get(secrets[2]) is not None


def test_a_sessionmaker_without_an_engine_is_refused() -> None:
    with pytest.raises(TypeError, match="bound to an Engine"):
        auth.token_cache(sessionmaker())
