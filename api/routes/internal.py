"""Routes the job driver calls on the cluster; not part of the user-facing API.

They take no user token: each attempt's driver holds a secret of its own (see service.auth.check_report_token),
so a driver can report only for its attempt, and a tenant's token cannot forge reports.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path
from starlette.concurrency import run_in_threadpool

from ringmaster.api.deps import DatabaseDep, check_report_token
from ringmaster.api.errors import error_responses
from ringmaster.api.limits import check_document
from ringmaster.api.schemas import ReportAck
from ringmaster.service import jobs
from ringmaster.service.db import Database, session_scope
from ringmaster.service.errors import InvalidSpec
from ringmaster.service.reports import DriverReport

router = APIRouter(prefix="/v1/internal", tags=["internal"], responses=error_responses(400, 401, 404, 409, 413))

# Report fields stored in 32-bit INTEGER columns (PostgreSQL's limit; SQLite would take more and differ).
_INT32_FIELDS = {
    "metrics": ("step", "world_size", "attempt"),
    "checkpoints": ("step", "world_size"),
    "memory": ("rank", "dp", "tp", "pp"),
}
_INT32_MAX = 2**31 - 1


def _check_int32(report: DriverReport) -> None:
    errors = [
        {
            "type": "less_than_equal",
            "loc": [section, index, field],
            "input": value,
            "msg": f"must be at most {_INT32_MAX}",
        }
        for section, fields in _INT32_FIELDS.items()
        for index, entry in enumerate(getattr(report, section))
        for field in fields
        if (value := getattr(entry, field)) is not None and value > _INT32_MAX
    ]
    if report.seq is not None and report.seq > _INT32_MAX:
        errors.append(
            {"type": "less_than_equal", "loc": ["seq"], "input": report.seq, "msg": f"must be at most {_INT32_MAX}"}
        )
    if errors:
        raise InvalidSpec(errors)


def _check_metric_attempts(report: DriverReport, attempt: int) -> None:
    """A replayed point names the earlier attempt that ran its step; no point can come from a later attempt."""
    errors = [
        {
            "type": "less_than_equal",
            "loc": ["metrics", index, "attempt"],
            "input": point.attempt,
            "msg": f"must be at most the reporting attempt ({attempt})",
        }
        for index, point in enumerate(report.metrics)
        if point.attempt is not None and point.attempt > attempt
    ]
    if errors:
        raise InvalidSpec(errors)


@router.post("/jobs/{job_id}/attempts/{attempt}/report", dependencies=[Depends(check_report_token)])
async def report(job_id: str, attempt: Annotated[int, Path(ge=1)], body: DriverReport, db: DatabaseDep) -> ReportAck:
    # Every running job's driver reports each second: the checks and the transaction go to the thread pool in one
    # hand-off, where a sync route with a session dependency took four (the session's start and end, the route, the
    # answer's validation).
    return await run_in_threadpool(_store_report, db, job_id, attempt, body)


def _store_report(db: Database, job_id: str, attempt: int, body: DriverReport) -> ReportAck:
    # Metric values may be NaN or infinite (a diverging loss); the free-form details are stored as JSON, which may not.
    check_document(body.details, loc=("details",))
    check_document(body.model_dump(exclude={"details"}), finite=False)
    _check_int32(body)
    _check_metric_attempts(body, attempt)
    with session_scope(db.sessions) as session:
        result = jobs.apply_driver_report(session, job_id, attempt, body)
    return ReportAck(
        state=result.state,
        accepted=result.accepted,
        preempting=result.preempting,
        preempted_for=result.preempted_for,
    )
