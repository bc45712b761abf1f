"""For tests that call the app in process: API tokens minted in its database, and every row its database holds."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import MetaData, Table, inspect, select

from ringmaster.service import auth
from ringmaster.service.db import session_scope
from ringmaster.service.models import DEFAULT_TENANT, Base


def mint(app: FastAPI, tenant: str = DEFAULT_TENANT, *, admin: bool = False) -> str:
    """A new token of tenant (created when missing) in the running app's database; the app must have started."""
    with session_scope(app.state.db.sessions) as session:
        return auth.create_token(session, tenant, admin=admin).secret


def authorize(client: TestClient, tenant: str = DEFAULT_TENANT, *, admin: bool = True) -> str:
    """Make every later request of client carry a new token of tenant (an admin's by default)."""
    token = mint(client.app, tenant, admin=admin)  # type: ignore[arg-type]
    client.headers["Authorization"] = f"Bearer {token}"
    return token


def table_rows(app: FastAPI) -> dict[str, list[tuple]]:
    """Every row of every table of the app's database (the schema's migrations' own table too), sorted: equal before
    and after a request that wrote nothing."""
    rows: dict[str, list[tuple]] = {}
    with app.state.db.engine.connect() as connection:
        for name in inspect(connection).get_table_names():
            table = Table(name, MetaData(), autoload_with=connection)
            rows[name] = sorted(map(tuple, connection.execute(select(table)).all()), key=repr)
    assert set(Base.metadata.tables) <= set(rows), "the app's database lacks a table of the models"
    return rows
