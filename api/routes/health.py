"""Liveness/readiness probe: the control plane is healthy when its database answers."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from ringmaster.api.deps import DatabaseDep
from ringmaster.api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, responses={503: {"model": Health}})
def healthz(db: DatabaseDep) -> Health | JSONResponse:
    try:
        with db.engine.connect() as connection:
            connection.exec_driver_sql("SELECT 1")
    except SQLAlchemyError as exc:
        return JSONResponse(
            status_code=503, content=Health(status="unavailable", database=str(exc.__class__.__name__)).model_dump()
        )
    return Health(status="ok", database="ok")
