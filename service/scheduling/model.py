"""What one scheduling pass reads and what it decides: plain, frozen data, free of Ray, torch and the database.

The live dispatcher builds these from Ray's node list and the job table; `ringmaster simulate` builds them from its
simulated cluster and trace. Both hand them to the same `plan()` (service/scheduling/plan.py), so what the simulator
shows at cluster scale is what the service does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


@dataclass(frozen=True, slots=True)
class WorkerShape:
    """One worker's resources: a bundle of `gpus` GPUs, or of `cpus` CPUs when gpus is 0 (as service.naming's
    worker_bundles places it: a GPU worker's bundle asks for GPUs alone)."""

    gpus: int
    cpus: float


@dataclass(frozen=True, slots=True)
class NodeView:
    """A node as the pass sees it: its total resources, and what is free after every running job's workers and
    every reservation ringmaster holds."""

    id: str
    total_gpus: int
    total_cpus: float
    free_gpus: int
    free_cpus: float
    # Going away (a drain): nothing new is placed here, and the jobs on it move off before the deadline.
    drain_deadline: float | None = None


@dataclass(frozen=True, slots=True)
class TenantView:
    name: str
    weight: float = 1.0
    # Dominant-resource share of the cluster, decayed over the recent past (fair_share.py keeps it).
    decayed_share: float = 0.0
    quota_gpus: int | None = None
    quota_cpus: float | None = None
    quota_jobs: int | None = None


@dataclass(frozen=True, slots=True)
class RunningJob:
    id: str
    tenant: str
    priority: int
    shape: WorkerShape
    nodes: tuple[str, ...]  # the node of each of its workers; len(nodes) is its world size now
    min_workers: int
    max_workers: int  # the most it may grow to (its spec's max, capped by its tenant's quota)
    preemptible: bool
    started_at: float  # when its current run (attempt) started: a minimum run time protects it
    last_resized_at: float | None = None
    attained_gpu_seconds: float = 0.0  # service received so far (least-attained-service ordering)
    # When it first joined the queue: preempted, it goes back to that place (None: its started_at stands in).
    submitted_at: float | None = None

    @property
    def workers(self) -> int:
        return len(self.nodes)


@dataclass(frozen=True, slots=True)
class QueuedJob:
    id: str
    tenant: str
    priority: int
    shape: WorkerShape
    min_workers: int
    max_workers: int
    preemptible: bool
    submitted_at: float  # when it joined the queue (first submit; a preempted job keeps its place)
    attained_gpu_seconds: float = 0.0
    # The job whose admission preempted this one, if any: it may not preempt that job back (no cycles).
    preempted_for: str | None = None


class PolicyName(StrEnum):
    FIFO = "fifo"  # priority, then age; a job that does not fit is passed over (ringmaster's admission before plans)
    BACKFILL = "backfill"  # fifo with a reservation for the head: smaller jobs run only where they do not delay it
    FAIR = "fair"  # backfill, with equal priorities ordered by tenant fair share; no resizes, no preemption
    ELASTIC = "elastic"  # fair, plus shrink, grow back and preemption of lower-priority work
    LAS = "las"  # Tiresias-style least attained service (a baseline for the simulator)


@dataclass(frozen=True, slots=True)
class PolicySettings:
    name: PolicyName = PolicyName.ELASTIC
    min_run_s: float = 300.0  # a job runs at least this long before it may be preempted
    min_resize_interval_s: float = 60.0  # between two resizes of one job
    fair_share_half_life_s: float = 3600.0
    # elastic: a job that has waited this long ranks first among its tenant's jobs of its priority, and the first such
    # job that does not fit claims room from the jobs of its priority ranked after it (in a later attained-service
    # queue, or the same and submitted later): their slack, then whole jobs. Free capacity it cannot use yet goes to
    # the jobs behind it rather than stay idle ...
    reserve_after_s: float = 1800.0
    # ... until it has waited this long: then, if its claim does not start it, the free capacity is held for it (from
    # every job when its wait is bounded by the protection of jobs it may take, else from jobs not preemptible).
    hold_after_s: float = 7200.0
    # elastic: for fair share alone (equal priority) a tenant's job is preempted, not only shrunk, while its tenant
    # holds more than this many times its weighted share.
    fair_share_preemption_above: float = 2.0
    # las: the attained GPU-seconds at which a job drops to the next queue (Tiresias's discretised 2D-LAS).
    las_thresholds_gpu_s: tuple[float, ...] = (3600.0, 36000.0, 360000.0)


@dataclass(frozen=True, slots=True)
class SchedulingInput:
    now: float
    nodes: tuple[NodeView, ...]
    running: tuple[RunningJob, ...]
    queued: tuple[QueuedJob, ...]
    tenants: tuple[TenantView, ...]
    policy: PolicySettings = PolicySettings()


@dataclass(frozen=True, slots=True)
class Admission:
    job_id: str
    workers: int
    nodes: tuple[str, ...]  # the node of each worker, as the plan packed them


@dataclass(frozen=True, slots=True)
class Resize:
    job_id: str
    workers: int  # the size to resize to
    # For a shrink: the nodes its leaving workers are on (one entry per worker), and the job it makes room for
    # (None when it moves off a draining node). For a grow: the nodes its new workers go on.
    nodes: tuple[str, ...]
    for_job: str | None = None


@dataclass(frozen=True, slots=True)
class Preemption:
    job_id: str
    for_job: str | None  # None: moved off a draining node at workers.min


@dataclass(frozen=True, slots=True)
class QueuePosition:
    job_id: str
    position: int  # 1-based, in plan order
    reason: str  # why it waits (what it waits for, what it would shrink or preempt); "" when admitted


@dataclass(frozen=True, slots=True)
class Plan:
    admissions: tuple[Admission, ...] = ()
    shrinks: tuple[Resize, ...] = ()
    grows: tuple[Resize, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    queue: tuple[QueuePosition, ...] = field(default=())  # every queued job, in plan order
