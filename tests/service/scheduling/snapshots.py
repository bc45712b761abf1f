"""Small builders of scheduling snapshots, so each test states only what it is about."""

from __future__ import annotations

from collections.abc import Iterable

from ringmaster.service.scheduling.model import (
    NodeView,
    PolicyName,
    PolicySettings,
    QueuedJob,
    RunningJob,
    SchedulingInput,
    TenantView,
    WorkerShape,
)

ONE_GPU = WorkerShape(gpus=1, cpus=1.0)
ONE_CPU = WorkerShape(gpus=0, cpus=1.0)


def gpu_nodes(count: int, gpus: int = 1, prefix: str = "n") -> list[NodeView]:
    return [NodeView(f"{prefix}{index}", gpus, 8.0, gpus, 8.0) for index in range(count)]


def running(
    job_id: str,
    nodes: Iterable[str],
    *,
    priority: int = 0,
    min_workers: int | None = None,
    max_workers: int | None = None,
    tenant: str = "t",
    preemptible: bool = True,
    started_at: float = 0.0,
    last_resized_at: float | None = None,
    attained_gpu_seconds: float = 0.0,
    shape: WorkerShape = ONE_GPU,
) -> RunningJob:
    placed = tuple(nodes)
    return RunningJob(
        id=job_id,
        tenant=tenant,
        priority=priority,
        shape=shape,
        nodes=placed,
        min_workers=len(placed) if min_workers is None else min_workers,
        max_workers=len(placed) if max_workers is None else max_workers,
        preemptible=preemptible,
        started_at=started_at,
        last_resized_at=last_resized_at,
        attained_gpu_seconds=attained_gpu_seconds,
    )


def queued(
    job_id: str,
    workers: int = 1,
    *,
    priority: int = 0,
    max_workers: int | None = None,
    tenant: str = "t",
    submitted_at: float = 0.0,
    preemptible: bool = True,
    preempted_for: str | None = None,
    attained_gpu_seconds: float = 0.0,
    shape: WorkerShape = ONE_GPU,
) -> QueuedJob:
    return QueuedJob(
        id=job_id,
        tenant=tenant,
        priority=priority,
        shape=shape,
        min_workers=workers,
        max_workers=workers if max_workers is None else max_workers,
        preemptible=preemptible,
        submitted_at=submitted_at,
        attained_gpu_seconds=attained_gpu_seconds,
        preempted_for=preempted_for,
    )


def occupied(nodes: list[NodeView], jobs: Iterable[RunningJob]) -> list[NodeView]:
    """The nodes with what the running jobs' workers hold taken off their free capacity."""
    taken: dict[str, tuple[int, float]] = {}
    for job in jobs:
        for node in job.nodes:
            gpus, cpus = taken.get(node, (0, 0.0))
            if job.shape.gpus > 0:
                taken[node] = (gpus + job.shape.gpus, cpus)
            else:
                taken[node] = (gpus, cpus + job.shape.cpus)
    views = []
    for node in nodes:
        gpus, cpus = taken.get(node.id, (0, 0.0))
        views.append(
            NodeView(
                node.id,
                node.total_gpus,
                node.total_cpus,
                node.total_gpus - gpus,
                node.total_cpus - cpus,
                node.drain_deadline,
            )
        )
    return views


def snapshot(
    nodes: list[NodeView],
    running_jobs: Iterable[RunningJob] = (),
    queued_jobs: Iterable[QueuedJob] = (),
    *,
    policy: PolicyName = PolicyName.ELASTIC,
    tenants: Iterable[TenantView] = (),
    now: float = 10_000.0,
    min_run_s: float = 300.0,
    min_resize_interval_s: float = 60.0,
) -> SchedulingInput:
    """A snapshot whose nodes' free capacity is what the running jobs leave."""
    jobs = tuple(running_jobs)
    return SchedulingInput(
        now=now,
        nodes=tuple(occupied(nodes, jobs)),
        running=jobs,
        queued=tuple(queued_jobs),
        tenants=tuple(tenants),
        policy=PolicySettings(name=policy, min_run_s=min_run_s, min_resize_interval_s=min_resize_interval_s),
    )
