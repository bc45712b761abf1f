"""Synthetic workloads for operators without a trace, and for tests: Poisson arrivals, sizes drawn from weights,
log-normal durations, tenants in turn by share, a share of elastic jobs. The same seed gives the same trace."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ringmaster.service.simulation.errors import SimulationInputError
from ringmaster.service.simulation.trace import TraceJob

# Most deep-learning jobs ask for one GPU and a few for many (the Philly and Helios studies' shape): these weights are
# this generator's illustration of it, not figures copied from either trace.
DEFAULT_SIZE_WEIGHTS = ((1, 50.0), (2, 15.0), (4, 15.0), (8, 12.0), (16, 5.0), (32, 3.0))
LONGEST_DURATION_S = 7 * 24 * 3600.0
SHORTEST_DURATION_S = 60.0


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """What a synthetic trace looks like; every field is an option of `ringmaster simulate-trace`."""

    jobs: int = 1000
    seed: int = 0
    arrivals_per_hour: float = 60.0  # a Poisson process's mean rate
    size_weights: tuple[tuple[int, float], ...] = DEFAULT_SIZE_WEIGHTS  # (GPUs, relative weight)
    duration_median_s: float = 1800.0  # log-normal durations at the requested size, kept within 1 min and 7 days
    duration_sigma: float = 1.5
    tenants: tuple[str, ...] = ("team-a", "team-b")  # each job's tenant drawn uniformly
    elastic_share: float = 0.5  # of jobs of 2 GPUs or more: elastic down to half their size
    high_priority_share: float = 0.1  # of jobs at priority 1 (the rest at 0)

    def __post_init__(self) -> None:
        if self.jobs < 1:
            raise SimulationInputError(f"a synthetic trace has at least 1 job, got {self.jobs}")
        if not self.arrivals_per_hour > 0 or not self.duration_median_s > 0 or self.duration_sigma < 0:
            raise SimulationInputError("arrivals per hour and the median duration are > 0, the sigma ≥ 0")
        if not self.size_weights or any(size < 1 or weight <= 0 for size, weight in self.size_weights):
            raise SimulationInputError("sizes are GPUS:WEIGHT pairs with GPUs ≥ 1 and weights > 0")
        if not self.tenants or any(not tenant for tenant in self.tenants):
            raise SimulationInputError("name at least one tenant")
        for name, share in (("elastic share", self.elastic_share), ("high-priority share", self.high_priority_share)):
            if not 0 <= share <= 1:
                raise SimulationInputError(f"the {name} is between 0 and 1, got {share}")


def generate(shape: WorkloadShape) -> tuple[TraceJob, ...]:
    """The jobs of a synthetic trace, in submit order, from one seeded random stream."""
    stream = random.Random(shape.seed)
    sizes = [size for size, _ in shape.size_weights]
    weights = [weight for _, weight in shape.size_weights]
    mean_gap_s = 3600.0 / shape.arrivals_per_hour
    mu = math.log(shape.duration_median_s)
    now = 0.0
    jobs = []
    for index in range(shape.jobs):
        if index:
            now += stream.expovariate(1.0 / mean_gap_s)
        gpus = stream.choices(sizes, weights)[0]
        duration = min(max(stream.lognormvariate(mu, shape.duration_sigma), SHORTEST_DURATION_S), LONGEST_DURATION_S)
        elastic = gpus >= 2 and stream.random() < shape.elastic_share
        jobs.append(
            TraceJob(
                job_id=f"job-{index:06d}",
                submit_time=round(now, 3),
                duration=round(duration, 3),
                gpus=gpus,
                tenant=stream.choice(shape.tenants),
                priority=1 if stream.random() < shape.high_priority_share else 0,
                min_gpus=gpus // 2 if elastic else None,
                preemptible=True,
            )
        )
    return tuple(jobs)
