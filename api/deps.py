"""Request-scoped dependencies: the database session, the settings and the cluster-shape provider live on app.state."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from service.db import Database, session_scope
from service.job_plan import ClusterShape
from service.settings import Settings


def get_database(request: Request) -> Database:
    database: Database = request.app.state.db
    return database


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_cluster_shape(request: Request) -> ClusterShape | None:
    """The nodes' shape from the app's provider, else from the settings; None when neither knows it."""
    provider = request.app.state.cluster_shape_provider
    shape: ClusterShape | None = provider() if provider is not None else None
    return shape or ClusterShape.from_settings(get_settings(request))


def get_session(request: Request) -> Iterator[Session]:
    """One transaction per request, committed before the response is sent (scope="function" below)."""
    with session_scope(get_database(request).sessions) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(get_settings)]
DatabaseDep = Annotated[Database, Depends(get_database)]
ClusterShapeDep = Annotated[ClusterShape | None, Depends(get_cluster_shape)]
