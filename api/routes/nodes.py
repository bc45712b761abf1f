"""The cluster's nodes, as an admin acts on them: a drain ahead of a node going away (a spot instance's notice,
maintenance). Ray's own `ray drain-node` does the same; either way the dispatcher moves the jobs on the node off it."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Path, Request, status

from ringmaster.api.deps import AdminPrincipal
from ringmaster.api.errors import error_responses
from ringmaster.api.schemas import DrainIn, DrainOut
from ringmaster.service.errors import ClusterUnavailable

router = APIRouter(prefix="/v1/nodes", tags=["nodes"], responses=error_responses(400, 401, 403, 413))

NodeId = Annotated[
    str, Path(pattern="^[0-9a-f]{56}$", description="The node's Ray id (hex), as `ray list nodes` shows it.")
]


@router.post("/{node_id}/drain", status_code=status.HTTP_202_ACCEPTED, responses=error_responses(404, 409, 503))
def drain_node(node_id: NodeId, body: DrainIn, _admin: AdminPrincipal, request: Request) -> DrainOut:
    """Drain a node: Ray places nothing new there, and each job on it moves off before the deadline (saved at a
    step boundary and resumed on other nodes, no step redone, no failure counted)."""
    drainer = request.app.state.node_drainer
    if drainer is None:
        raise ClusterUnavailable("this server drives no Ray cluster: nodes are drained where it runs with one")
    deadline = time.time() + body.deadline_s if body.deadline_s is not None else None
    drainer(node_id, deadline, body.reason)
    return DrainOut(
        node_id=node_id,
        deadline=datetime.fromtimestamp(deadline, UTC) if deadline is not None else None,
        reason=body.reason,
    )
