"""Small builders of scheduling snapshots, so each test states only what it is about."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import replace

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
    submitted_at: float | None = None,
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
        submitted_at=submitted_at,
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


def random_snapshot(rng: random.Random, policy: PolicyName, nodes: int = 12, queued_jobs: int = 40) -> SchedulingInput:
    """A busy mixed cluster: 4-GPU nodes (one draining), GPU and CPU jobs, priorities, elastic ranges, protected
    jobs, quotas near what tenants hold, and jobs preempted earlier."""
    views = [NodeView(f"n{index}", 4, 8.0, 4, 8.0, 10_300.0 if index == nodes - 1 else None) for index in range(nodes)]
    free = {view.id: [4, 8.0] for view in views}
    shapes = (WorkerShape(1, 1.0), WorkerShape(2, 1.0), WorkerShape(0, 2.0))
    tenant_names = ("a", "b", "c")
    runs: list[RunningJob] = []
    for index in range(nodes * 2):
        shape = rng.choice(shapes)
        resource, need = (0, shape.gpus) if shape.gpus > 0 else (1, shape.cpus)
        size = rng.randint(1, 4)
        placed: list[str] = []
        start = rng.randrange(nodes)
        for node in (f"n{(start + offset) % nodes}" for offset in range(nodes)):
            if len(placed) == size:
                break
            while free[node][resource] >= need and len(placed) < size:
                free[node][resource] -= need
                placed.append(node)
        if not placed:
            continue
        minimum = rng.randint(1, len(placed))
        runs.append(
            running(
                f"r{index}",
                placed,
                priority=rng.randint(0, 3),
                min_workers=minimum,
                max_workers=len(placed) + rng.randint(0, 2),
                tenant=rng.choice(tenant_names),
                preemptible=rng.random() < 0.8,
                started_at=rng.choice((9_900.0, 5_000.0)),
                last_resized_at=rng.choice((None, 9_990.0)),
                attained_gpu_seconds=rng.choice((0.0, 5e4, 5e5)),
                shape=shape,
            )
        )
    held: dict[str, list[float]] = {name: [0.0, 0.0, 0.0] for name in tenant_names}
    for job in runs:
        held[job.tenant][0] += job.shape.gpus * job.workers
        held[job.tenant][1] += job.shape.cpus * job.workers
        held[job.tenant][2] += 1
    tenants = [
        TenantView("a", weight=1.0, decayed_share=rng.random()),
        TenantView("b", weight=2.0, decayed_share=rng.random(), quota_gpus=int(held["b"][0]) + 6),
        TenantView("c", decayed_share=rng.random(), quota_cpus=held["c"][1] + 4.0, quota_jobs=int(held["c"][2]) + 3),
    ]
    waits = []
    for index in range(queued_jobs):
        minimum = rng.randint(1, 4)
        waits.append(
            queued(
                f"q{index}",
                minimum,
                priority=rng.randint(0, 4),
                max_workers=minimum + rng.randint(0, 3),
                tenant=rng.choice(tenant_names),
                submitted_at=float(rng.randint(0, 50)),
                preemptible=rng.random() < 0.8,
                preempted_for=rng.choice([None, None, None, *(job.id for job in runs[:3])]),
                attained_gpu_seconds=rng.choice((0.0, 5e4)),
                shape=rng.choice(shapes),
            )
        )
    state = snapshot(views, runs, waits, policy=policy, tenants=tenants)
    return replace(
        state, nodes=tuple(replace(node, drain_deadline=view.drain_deadline) for node, view in zip(state.nodes, views))
    )
