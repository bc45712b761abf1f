"""The figures a simulation is judged by, per policy: job completion time and queueing delay, makespan, GPU
utilization, how often jobs were preempted or resized, fairness between tenants and to each job, and what the plan
function cost per pass."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ringmaster.service.simulation.engine import SimulationRun

# Figures where a smaller value is the better one; the rest (utilization, Jain's index) are better larger.
SMALLER_IS_BETTER = frozenset(
    {
        "jct_mean_s",
        "jct_median_s",
        "jct_p95_s",
        "jct_p99_s",
        "wait_mean_s",
        "wait_median_s",
        "wait_p95_s",
        "wait_p99_s",
        "longest_wait_s",
        "makespan_s",
        "preemptions_per_job",
        "resizes_per_job",
        "lost_gpu_hours",
        "worst_finish_time_fairness",
        "decision_cpu_ms_median",
        "decision_cpu_ms_max",
    }
)


@dataclass(frozen=True, slots=True)
class PolicyMetrics:
    jobs: int
    jct_mean_s: float  # job completion time: finish − submit
    jct_median_s: float
    jct_p95_s: float
    jct_p99_s: float
    wait_mean_s: float  # queueing delay: every second a job spent queued (before it started and after preemptions)
    wait_median_s: float
    wait_p95_s: float
    wait_p99_s: float
    longest_wait_s: float  # the most any one job waited: no job starves
    makespan_s: float  # first submit to last finish
    gpu_utilization: float  # GPU-seconds held by jobs over the cluster's GPU-seconds across the makespan
    preemptions_per_job: float
    resizes_per_job: float  # shrinks and grows
    lost_gpu_hours: float  # GPU-hours of running that preemptions threw away (since a checkpoint)
    jain_index: float  # Jain's index of the tenants' GPU-seconds, each over its weight: 1 is equal
    worst_finish_time_fairness: float  # the largest ρ = JCT shared / JCT alone (its duration at its requested size)
    decision_cpu_ms_median: float  # the plan function's CPU time per pass
    decision_cpu_ms_max: float
    passes: int
    most_queued_at_a_pass: int

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def measure(run: SimulationRun) -> PolicyMetrics:
    """Summarize a run; a job's completion time alone is its trace duration (it would start at once, at full size)."""
    finished = [job for job in run.jobs if not math.isnan(job.first_started_at)]
    completion = np.array([job.completion_time for job in finished])
    waits = np.array([job.waited_s for job in finished])
    alone = np.array([job.duration for job in finished])
    first_submit = min((job.submitted_at for job in run.jobs), default=0.0)
    makespan = max((job.finished_at for job in finished), default=first_submit) - first_submit
    count = len(finished)
    return PolicyMetrics(
        jobs=count,
        jct_mean_s=_mean(completion),
        jct_median_s=_percentile(completion, 50),
        jct_p95_s=_percentile(completion, 95),
        jct_p99_s=_percentile(completion, 99),
        wait_mean_s=_mean(waits),
        wait_median_s=_percentile(waits, 50),
        wait_p95_s=_percentile(waits, 95),
        wait_p99_s=_percentile(waits, 99),
        longest_wait_s=float(waits.max()) if count else 0.0,
        makespan_s=makespan,
        gpu_utilization=run.allocated_gpu_seconds / (run.cluster.gpus * makespan) if makespan > 0 else 0.0,
        preemptions_per_job=sum(job.preemptions for job in finished) / count if count else 0.0,
        resizes_per_job=sum(job.shrinks + job.grows for job in finished) / count if count else 0.0,
        lost_gpu_hours=sum(job.lost_s * job.gpus for job in finished) / 3600.0,
        jain_index=jain_index(
            [seconds / run.tenant_weights[tenant] for tenant, seconds in run.tenant_gpu_seconds.items()]
        ),
        worst_finish_time_fairness=float((completion / alone).max()) if count else 0.0,
        decision_cpu_ms_median=_percentile(np.array(run.decision_cpu_ms), 50),
        decision_cpu_ms_max=max(run.decision_cpu_ms, default=0.0),
        passes=len(run.decision_cpu_ms),
        most_queued_at_a_pass=max(run.queued_at_pass, default=0),
    )


def jain_index(values: Sequence[float]) -> float:
    """(Σx)² / (n·Σx²): 1 when every value is equal, 1/n when one holds everything; 1 for no usage at all."""
    squares = sum(value * value for value in values)
    if not values or squares == 0:
        return 1.0
    return sum(values) ** 2 / (len(values) * squares)


def ratios(metrics: PolicyMetrics, baseline: PolicyMetrics) -> dict[str, float | None]:
    """Each figure over the baseline's; None where the baseline's is 0 (a ratio to nothing says nothing)."""
    ours, theirs = metrics.as_dict(), baseline.as_dict()
    return {name: (value / theirs[name] if theirs[name] else None) for name, value in ours.items()}


def utilization_timeline(run: SimulationRun, buckets: int) -> list[tuple[float, float, float]]:
    """(bucket start, mean GPU utilization, mean jobs queued) over `buckets` equal spans of the run, time-weighted."""
    timeline = run.timeline
    if not timeline:
        return []
    start, end = timeline[0][0], timeline[-1][0]
    width = (end - start) / buckets if end > start else 1.0
    held = np.zeros(buckets)
    queued = np.zeros(buckets)
    for (at, gpus, waiting), (next_at, _, _) in itertools.pairwise(timeline):
        _spread(held, queued, (at - start) / width, (next_at - start) / width, gpus, waiting)
    total = run.cluster.gpus
    return [(start + index * width, held[index] / total, queued[index]) for index in range(buckets)]


def _spread(held: np.ndarray, queued: np.ndarray, begin: float, end: float, gpus: int, waiting: int) -> None:
    """Add a level held from `begin` to `end` (in bucket units) to each bucket it covers, by the share it covers."""
    last = len(held) - 1
    while end > begin:
        index = min(int(begin), last)
        upto = min(end, index + 1.0) if index < last else end
        share = upto - begin
        held[index] += gpus * share
        queued[index] += waiting * share
        begin = upto


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.size else 0.0


def _percentile(values: np.ndarray, percent: float) -> float:
    return float(np.percentile(values, percent)) if values.size else 0.0
