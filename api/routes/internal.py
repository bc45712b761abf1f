"""Routes the job driver calls on the cluster; not part of the user-facing API."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from api.deps import SessionDep
from api.schemas import ReportAck
from service import jobs
from service.reports import DriverReport

router = APIRouter(prefix="/v1/internal", tags=["internal"])


@router.post("/jobs/{job_id}/attempts/{attempt}/report")
def report(job_id: str, attempt: Annotated[int, Path(ge=1)], body: DriverReport, session: SessionDep) -> ReportAck:
    result = jobs.apply_driver_report(session, job_id, attempt, body)
    return ReportAck(state=result.state, accepted=result.accepted)
