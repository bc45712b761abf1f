"""API tokens for tests that call the app in process: mint one in the app's database and send it."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from ringmaster.service import auth
from ringmaster.service.db import session_scope
from ringmaster.service.models import DEFAULT_TENANT


def mint(app: FastAPI, tenant: str = DEFAULT_TENANT, *, admin: bool = False) -> str:
    """A new token of tenant (created when missing) in the running app's database; the app must have started."""
    with session_scope(app.state.db.sessions) as session:
        return auth.create_token(session, tenant, admin=admin).secret


def authorize(client: TestClient, tenant: str = DEFAULT_TENANT, *, admin: bool = True) -> str:
    """Make every later request of client carry a new token of tenant (an admin's by default)."""
    token = mint(client.app, tenant, admin=admin)  # type: ignore[arg-type]
    client.headers["Authorization"] = f"Bearer {token}"
    return token
