"""Names the control plane and the job driver both derive: the Ray namespace, a job attempt's placement group
and Ray submission id, and the shape of a worker's bundle. A shared contract, so neither side guesses the other's."""

from __future__ import annotations

NAMESPACE = "ringmaster"
JOB_ID_LENGTH = 32  # hex digits (uuid4().hex)
TENSORBOARD_DIR = "tensorboard"  # below a job's storage root: attempt-<n>/ holds each attempt's event files


def placement_group_name(job_id: str, attempt: int) -> str:
    return f"ringmaster-{job_id}-{attempt}"


def submission_id_for(job_id: str, attempt: int) -> str:
    """Derived from job and attempt, so resubmitting the same attempt is refused by Ray, not run twice."""
    return f"ringmaster-{job_id}-{attempt}"


def worker_bundles(gpus_per_worker: int, cpus_per_worker: float, count: int) -> list[dict[str, float]]:
    bundle = {"GPU": float(gpus_per_worker)} if gpus_per_worker > 0 else {"CPU": float(cpus_per_worker)}
    return [dict(bundle) for _ in range(count)]


def workers_fitting(nodes: list[dict[str, float]], gpus_per_worker: int, cpus_per_worker: float) -> int:
    """How many workers' bundles (worker_bundles) these nodes' total resources hold, each bundle on one node."""
    [(resource, need)] = worker_bundles(gpus_per_worker, cpus_per_worker, 1)[0].items()
    return sum(int(node.get(resource, 0.0) // need) for node in nodes) if need > 0 else 0
