"""Every private or experimental Ray API that ringmaster's Ray agent and job driver rely on, each behind one small
function or class, for the Ray that pyproject.toml pins (`TESTED_RAY`).

Ray promises nothing about `ray.experimental` or names with a leading underscore. tests/service/test_ray_internals.py
checks each one's name and signature, and tests/cluster/test_ray_secrets.py its meaning on a live cluster, so a Ray
release that moves or changes one fails there, by name, rather than as a driver that cannot start.

Imported only by processes that have joined a Ray cluster: importing Ray takes seconds.
"""

from __future__ import annotations

from typing import Any

from ray._private import state as ray_state
from ray.experimental import internal_kv

TESTED_RAY = "==2.58.0"  # keep equal to the ray requirement in pyproject.toml


class RayInternalKv:
    """Ray's GCS key-value store (its internal KV), as this process's Ray connection reaches it. No dashboard API
    lists it, and every client needs the cluster's credentials to reach it: a place for secrets, unlike a runtime_env
    or a command line. Usable once ray.init has returned."""

    def put(self, namespace: str, key: str, value: bytes) -> None:
        """Store value at key, replacing what was there."""
        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=namespace)

    def get(self, namespace: str, key: str) -> bytes | None:
        """The value at key; None when there is none."""
        value: bytes | None = internal_kv._internal_kv_get(key, namespace=namespace)
        return value

    def delete(self, namespace: str, key: str) -> bool:
        """Remove key; whether it was there (of two deleting at once, one alone is told True)."""
        deleted: int = internal_kv._internal_kv_del(key, namespace=namespace)
        return deleted > 0


def free_resources_by_node() -> dict[str, dict[str, float]]:
    """Each live node's unreserved resources now (node id → resource → amount): what placement groups and actors
    leave. Ray's public API gives only the cluster's sum (`ray.available_resources`); the scheduler plans per node."""
    free: dict[str, dict[str, float]] = ray_state.available_resources_per_node()  # type: ignore[no-untyped-call]
    return free


def draining_nodes() -> dict[str, float | None]:
    """Each node Ray is draining (`ray drain-node`, the autoscaler, or drain_node below): node id → the deadline by
    which it goes, in seconds since the epoch (None: no deadline given). Ray's public API does not say which nodes
    drain; its scheduler already places nothing new there."""
    deadlines: dict[str, int] = ray_state.state.get_draining_nodes()
    return {node_id: (deadline_ms / 1000 if deadline_ms else None) for node_id, deadline_ms in deadlines.items()}


def drain_node(node_id: str, deadline: float | None, reason: str) -> str | None:
    """Ask Ray's GCS to drain a node as one about to be preempted (a spot notice, maintenance), as `ray drain-node
    --reason DRAIN_NODE_REASON_PREEMPTION` does; None when accepted, else Ray's reason for refusing."""
    from ray._private.worker import global_worker
    from ray.core.generated import autoscaler_pb2

    gcs_client: Any = global_worker.gcs_client  # type: ignore[attr-defined]  # set by ray.init, undeclared by Ray
    reasons: Any = autoscaler_pb2.DrainNodeReason  # type: ignore[attr-defined]  # generated, without stubs
    accepted, refusal = gcs_client.drain_node(
        node_id,
        reasons.Value("DRAIN_NODE_REASON_PREEMPTION"),
        reason,
        int(deadline * 1000) if deadline is not None else 0,
    )
    return None if accepted else str(refusal or "refused")
