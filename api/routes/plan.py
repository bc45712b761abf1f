"""The planner over REST: a model and a cluster in, the options table and the pick out."""

from __future__ import annotations

from fastapi import APIRouter

from ringmaster.api.deps import CurrentPrincipal
from ringmaster.api.errors import error_responses
from ringmaster.api.schemas import PlanOut, PlanRequest
from ringmaster.service import planner

router = APIRouter(prefix="/v1", tags=["plan"], responses=error_responses(400, 401, 413))


@router.post("/plan")
def plan(body: PlanRequest, _principal: CurrentPrincipal) -> PlanOut:
    """Predicted memory per GPU, communication per step and bubble for each strategy, and the recommendation."""
    return PlanOut.from_plan(planner.plan(body.model_size(), body.cluster(), body.workload()), body)
