"""The planner over REST: a model and a cluster in, the options table and the pick out."""

from __future__ import annotations

from fastapi import APIRouter

from api.schemas import PlanOut, PlanRequest
from service import planner

router = APIRouter(prefix="/v1", tags=["plan"])


@router.post("/plan")
def plan(body: PlanRequest) -> PlanOut:
    """Predicted memory per GPU, communication per step and bubble for each strategy, and the recommendation."""
    return PlanOut.from_plan(planner.plan(body.model_size(), body.cluster(), body.workload()), body)
