"""Request-scoped dependencies: the caller (from its bearer token), the database session and the settings (the last
two live on app.state); and the cluster's shape, read in a route's worker thread.

The cheap ones are ``async def``: FastAPI runs a plain ``def`` dependency in its thread pool, a hand-off that
cost more than the work itself on every request. Whatever may block (a query, Ray) still goes to the pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from ringmaster.service import auth
from ringmaster.service.auth import Principal
from ringmaster.service.db import Database, session_scope
from ringmaster.service.job_plan import ClusterShape
from ringmaster.service.settings import Settings

_user_token = HTTPBearer(
    auto_error=False,
    scheme_name="token",
    description="An API token (`ringmaster token create`) as `Authorization: Bearer <token>`.",
)
_report_token = HTTPBearer(
    auto_error=False,
    scheme_name="reportToken",
    description="The job driver's per-attempt secret, which the dispatcher hands it at submission.",
)


async def get_database(request: Request) -> Database:
    database: Database = request.app.state.db
    return database


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def read_cluster_shape(request: Request) -> ClusterShape | None:
    """The nodes' shape from the app's provider, else from the settings; the provider may ask Ray, so never call this
    on the event loop."""
    provider = request.app.state.cluster_shape_provider
    shape: ClusterShape | None = provider() if provider is not None else None
    return shape or ClusterShape.from_settings(request.app.state.settings)


def get_session(request: Request) -> Iterator[Session]:
    """One transaction per request, committed before the response is sent (scope="function" below)."""
    with session_scope(request.app.state.db.sessions) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(get_settings)]
DatabaseDep = Annotated[Database, Depends(get_database)]


async def get_principal(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_user_token)]
) -> Principal:
    """The caller behind the bearer token: from the token cache, else looked up in a short transaction before the
    route's."""
    if credentials is None:
        if request.headers.get("authorization"):
            raise auth.Unauthorized("malformed Authorization header: expected 'Bearer <token>'")
        raise auth.Unauthorized(
            "missing API token: send 'Authorization: Bearer <token>' (`ringmaster token create` makes one)"
        )
    sessions = request.app.state.db.sessions
    cache = auth.token_cache(sessions)
    principal = cache.get(credentials.credentials)
    if principal is None:
        principal = await run_in_threadpool(cache.load, sessions, credentials.credentials)
    return principal


async def get_admin(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    auth.require_admin(principal)
    return principal


async def check_report_token(
    request: Request,
    job_id: str,
    attempt: int,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_report_token)],
) -> None:
    """Only the driver of this very attempt may report for it (path: /jobs/{job_id}/attempts/{attempt}/...); a token
    already found good is not looked up again."""
    secret = credentials.credentials if credentials else None
    checked: auth.CheckedReportTokens = request.app.state.checked_report_tokens
    if not checked.known(job_id, attempt, secret):
        await run_in_threadpool(checked.check, request.app.state.db.sessions, job_id, attempt, secret)


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]
AdminPrincipal = Annotated[Principal, Depends(get_admin)]
