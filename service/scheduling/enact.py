"""The snapshot after a plan is carried out in full: what the next pass reads if every decision takes effect at once.

The live dispatcher learns the outcome from Ray and the database instead; the tests, the benchmark and a simulator
step that ignores resize and restart costs use this to chain passes.
"""

from __future__ import annotations

from dataclasses import replace

from ringmaster.service.scheduling.model import NodeView, Plan, QueuedJob, RunningJob, SchedulingInput, WorkerShape


def enacted(state: SchedulingInput, decided: Plan) -> SchedulingInput:
    """Admitted jobs run from `state.now`, resized jobs have their new nodes, preempted jobs are queued again in their
    old place with the job they made way for, and every node's free capacity follows."""
    taken: dict[str, list[float]] = {node.id: [0.0, 0.0] for node in state.nodes}  # node → [gpus, cpus] newly taken

    def take(shape: WorkerShape, node: str, workers: int) -> None:
        if node in taken:
            if shape.gpus > 0:
                taken[node][0] += shape.gpus * workers
            else:
                taken[node][1] += shape.cpus * workers

    queued = {job.id: job for job in state.queued}
    running = {job.id: job for job in state.running}
    for shrink in decided.shrinks:
        job = running[shrink.job_id]
        kept = list(job.nodes)
        for node in shrink.nodes:
            kept.remove(node)
            take(job.shape, node, -1)
        running[job.id] = replace(job, nodes=tuple(kept), last_resized_at=state.now)
    for grow in decided.grows:
        job = running[grow.job_id]
        for node in grow.nodes:
            take(job.shape, node, 1)
        running[job.id] = replace(job, nodes=job.nodes + grow.nodes, last_resized_at=state.now)
    requeued: list[QueuedJob] = []
    for preemption in decided.preemptions:
        job = running.pop(preemption.job_id)
        for node in job.nodes:
            take(job.shape, node, -1)
        requeued.append(
            QueuedJob(
                id=job.id,
                tenant=job.tenant,
                priority=job.priority,
                shape=job.shape,
                min_workers=job.min_workers,
                max_workers=job.max_workers,
                preemptible=job.preemptible,
                submitted_at=job.started_at if job.submitted_at is None else job.submitted_at,
                attained_gpu_seconds=job.attained_gpu_seconds,
                preempted_for=preemption.for_job,
            )
        )
    for admission in decided.admissions:
        waiting = queued.pop(admission.job_id)
        for node in admission.nodes:
            take(waiting.shape, node, 1)
        running[waiting.id] = RunningJob(
            id=waiting.id,
            tenant=waiting.tenant,
            priority=waiting.priority,
            shape=waiting.shape,
            nodes=admission.nodes,
            min_workers=waiting.min_workers,
            max_workers=waiting.max_workers,
            preemptible=waiting.preemptible,
            started_at=state.now,
            attained_gpu_seconds=waiting.attained_gpu_seconds,
            submitted_at=waiting.submitted_at,
        )
    after = tuple(
        replace(node, free_gpus=node.free_gpus - int(taken[node.id][0]), free_cpus=node.free_cpus - taken[node.id][1])
        if taken[node.id] != [0.0, 0.0]
        else node
        for node in state.nodes
    )
    return replace(
        state,
        nodes=after,
        running=tuple(running.values()),
        queued=tuple(queued.values()) + tuple(requeued),
    )


def without_job(state: SchedulingInput, job_id: str) -> SchedulingInput:
    """The snapshot after a running job ends: its workers' capacity is free again."""
    ended = next(job for job in state.running if job.id == job_id)
    freed: dict[str, int] = {}
    for node_id in ended.nodes:
        freed[node_id] = freed.get(node_id, 0) + 1
    nodes: list[NodeView] = []
    for node in state.nodes:
        workers = freed.get(node.id, 0)
        if ended.shape.gpus > 0:
            nodes.append(replace(node, free_gpus=node.free_gpus + ended.shape.gpus * workers))
        else:
            nodes.append(replace(node, free_cpus=node.free_cpus + ended.shape.cpus * workers))
    return replace(state, nodes=tuple(nodes), running=tuple(job for job in state.running if job.id != job_id))
