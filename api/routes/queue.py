"""The queue as the dispatcher planned it, with why each job waits, and the tenants' fair-share standing and series.

A tenant's token sees its own jobs and standing alone (the positions stay those of the whole queue, so a team knows
how far it is from the front); an admin's sees every tenant's. Asking for another tenant's answers nothing, as a job
of another tenant is not found.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Query

from ringmaster.api.deps import CurrentPrincipal, SessionDep
from ringmaster.api.errors import JSONModelResponse, error_responses
from ringmaster.api.schemas import (
    QueuedJobOut,
    QueueOut,
    SharePointOut,
    ShareSeriesOut,
    TenantSharesOut,
    TenantStandingOut,
)
from ringmaster.service import queue_view, tenants
from ringmaster.service.auth import Principal
from ringmaster.service.models import utcnow

router = APIRouter(prefix="/v1/queue", tags=["queue"], responses=error_responses(401))

TenantFilter = Annotated[
    str | None,
    Query(pattern=tenants.NAME_PATTERN, max_length=64, description="Only this tenant's jobs and standing."),
]
MAX_SERIES_MINUTES = int(queue_view.SHARE_RETENTION / timedelta(minutes=1))


def _visible(principal: Principal, tenant: str | None) -> tuple[str | None, bool]:
    """The tenant to filter by, and whether the caller may see anything of it at all."""
    if principal.scope is None:
        return tenant, True
    return principal.scope, tenant in (None, principal.scope)


@router.get("", response_model=QueueOut)
def queue(
    principal: CurrentPrincipal,
    session: SessionDep,
    tenant: TenantFilter = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
) -> JSONModelResponse:
    """The QUEUED jobs in the order the dispatcher will start them, each with why it waits; the tenants' standing."""
    shown, visible = _visible(principal, tenant)
    if not visible:
        return JSONModelResponse(QueueOut(items=[], total=0, limit=limit, offset=offset, tenants=[]))
    page = queue_view.queue_page(session, tenant=shown, limit=limit, offset=offset)
    answer = QueueOut(
        items=[QueuedJobOut.model_validate(job) for job in page.items],
        total=page.total,
        limit=page.limit,
        offset=page.offset,
        tenants=[TenantStandingOut.from_standing(row) for row in queue_view.tenant_standing(session, tenant=shown)],
    )
    return JSONModelResponse(answer)  # a long page is cheaper serialized by pydantic alone (api.errors)


@router.get("/shares")
def shares(
    principal: CurrentPrincipal,
    session: SessionDep,
    tenant: TenantFilter = None,
    minutes: Annotated[
        int, Query(ge=1, le=MAX_SERIES_MINUTES, description="How far back; the series is kept for a week.")
    ] = 60,
) -> ShareSeriesOut:
    """Each tenant's share, decayed share and entitled share over time, as the dispatcher sampled them."""
    since = utcnow() - timedelta(minutes=minutes)
    shown, visible = _visible(principal, tenant)
    series = queue_view.share_series(session, since, tenant=shown) if visible else {}
    return ShareSeriesOut(
        since=since,
        series=[
            TenantSharesOut(tenant=name, points=[SharePointOut.model_validate(point) for point in points])
            for name, points in sorted(series.items())
        ],
    )
