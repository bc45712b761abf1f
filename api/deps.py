"""Request-scoped dependencies: the database session and the settings live on app.state."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from service.db import Database, session_scope
from service.settings import Settings


def get_database(request: Request) -> Database:
    database: Database = request.app.state.db
    return database


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    """One transaction per request, committed before the response is sent (scope="function" below)."""
    with session_scope(get_database(request).sessions) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(get_settings)]
DatabaseDep = Annotated[Database, Depends(get_database)]
