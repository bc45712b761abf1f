"""Synthetic workloads for operators without a trace, and for tests: Poisson arrivals, sizes drawn from weights,
log-normal durations, tenants in turn by share, a share of elastic jobs. The same seed gives the same trace.

`helios_shape()` is a preset drawn from the published figures of SenseTime's Helios trace (Hu et al., "Characterization
and Prediction of Deep Learning Workloads in Large-Scale GPU Datacenters", SC '21, and its artifact
github.com/S-Lab-System-Group/HeliosArtifact), each figure's source beside it."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

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


# --- the Helios preset ------------------------------------------------------------------------------------------------
# Job sizes: the share of GPU jobs at each GPU count, all four public Helios clusters (Venus, Earth, Saturn, Uranus)
# weighted by their GPU jobs. Read from the paper's CDF of GPU job sizes by number of jobs, as the artifact draws it
# (analysis/3_job characterization/job_cdf_gpunum.pdf, a vector figure whose points are the CDF at 1, 2, 4, 8, 12, 16,
# 24, 32, 40, 48, 56, 64 and all GPUs; read to ±0.1 %). Each cluster's CDF weighted by its GPU jobs gives 72.19 % at
# 1 GPU, 74.75 % at ≤ 2, 80.47 % ≤ 4, 94.69 % ≤ 8, 94.70 % ≤ 12, 97.72 % ≤ 16, 98.08 % ≤ 24, 99.35 % ≤ 32, 99.73 %
# ≤ 64. A bucket becomes its upper size (12 → 16, 24 → 32) and the 0.27 % above 64 GPUs is drawn at 64, so a trace
# fits a 64-GPU cluster. The mean, 3.56 GPUs, is the artifact's published 3.716 (helios_cluster_summary.csv,
# avg_gpu_num, total) less what capping the few largest jobs at 64 removes.
HELIOS_SIZE_WEIGHTS = ((1, 72.19), (2, 2.56), (4, 5.72), (8, 14.22), (16, 3.03), (32, 1.63), (64, 0.65))
# GPU job durations: the artifact's helios_cluster_summary.csv (all clusters): median 206 s (med_run_time_gpu) and mean
# 6,651.681 s (avg_run_time_gpu). A log-normal with that median and mean has sigma = sqrt(2 ln(mean / median)) = 2.636;
# the log-normal is this generator's model, the two figures are Helios's.
HELIOS_DURATION_MEDIAN_S = 206.0
HELIOS_DURATION_MEAN_S = 6651.681
# Load: the same summary's GPU time of completed, cancelled and failed GPU jobs (39,994,296,320 + 30,715,109,125 +
# 7,288,334,702 GPU-seconds) over its 6,220 GPUs for the trace's 6 months (April to September 2020, 183 days): the
# Helios clusters' GPUs were held 79.3 % of the time.
HELIOS_GPU_SECONDS = 39_994_296_320.0 + 30_715_109_125.0 + 7_288_334_702.0
HELIOS_GPUS = 6220
HELIOS_SPAN_S = 183 * 86400.0
HELIOS_LOAD = HELIOS_GPU_SECONDS / (HELIOS_GPUS * HELIOS_SPAN_S)


def helios_shape(cluster_gpus: int = 64, jobs: int = 1000, seed: int = 0) -> WorkloadShape:
    """Helios's sizes and durations, arriving at the rate that loads a cluster of `cluster_gpus` as Helios's jobs
    loaded Helios (79.3 %). Not Helios's 0.058 jobs per GPU-hour (1,580,464 GPU jobs): its large jobs also ran
    longer, which independent draws of size and duration do not reproduce, so its rate would load this model's
    cluster about 30 %. Tenants, elastic and high-priority shares are the generator's defaults, not Helios's."""
    sigma = math.sqrt(2.0 * math.log(HELIOS_DURATION_MEAN_S / HELIOS_DURATION_MEDIAN_S))
    shape = WorkloadShape(
        jobs=jobs,
        seed=seed,
        size_weights=HELIOS_SIZE_WEIGHTS,
        duration_median_s=HELIOS_DURATION_MEDIAN_S,
        duration_sigma=sigma,
    )
    gpu_seconds_per_job = expected_size(shape) * expected_duration_s(shape)
    return replace(shape, arrivals_per_hour=HELIOS_LOAD * cluster_gpus * 3600.0 / gpu_seconds_per_job)


def expected_size(shape: WorkloadShape) -> float:
    total = sum(weight for _, weight in shape.size_weights)
    return sum(size * weight for size, weight in shape.size_weights) / total


def expected_duration_s(shape: WorkloadShape) -> float:
    """The mean of the log-normal duration as generate() draws it: clamped to [1 min, 7 days]."""
    mu, sigma = math.log(shape.duration_median_s), shape.duration_sigma
    low, high = SHORTEST_DURATION_S, LONGEST_DURATION_S
    if sigma == 0:
        return min(max(shape.duration_median_s, low), high)

    def below(x: float) -> float:  # P(duration < x)
        return 0.5 * (1.0 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2.0))))

    def partial(x: float) -> float:  # E[duration; duration < x]
        return (
            math.exp(mu + sigma**2 / 2)
            * 0.5
            * (1.0 + math.erf((math.log(x) - mu - sigma**2) / (sigma * math.sqrt(2.0))))
        )

    return low * below(low) + partial(high) - partial(low) + high * (1.0 - below(high))


PRESETS = {"helios": helios_shape}
