"""The figures: percentiles, makespan, utilization, finish-time fairness and Jain's index, on runs whose answers are
known."""

from __future__ import annotations

import pytest

from ringmaster.service.scheduling.model import PolicyName
from ringmaster.service.scheduling.plan import plan
from ringmaster.service.simulation.engine import ClusterShape, Simulation
from ringmaster.service.simulation.metrics import jain_index, measure, ratios, utilization_timeline
from ringmaster.service.simulation.settings import SimulationSettings
from ringmaster.service.simulation.trace import TraceJob

LIVE_INTERVAL = SimulationSettings(scheduling_interval_s=0.5)  # passes at arrivals and completions, to the second


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([1.0, 1.0, 1.0, 1.0], 1.0),
        ([1.0, 0.0, 0.0, 0.0], 0.25),
        ([1.0, 2.0], 0.9),  # 9 / (2 · 5)
        ([3.0, 1.0], 0.8),  # 16 / (2 · 10)
        ([], 1.0),
        ([0.0, 0.0], 1.0),
    ],
)
def test_jains_index_of_known_vectors(values: list[float], expected: float) -> None:
    assert jain_index(values) == pytest.approx(expected)


def _two_jobs_one_after_the_other():
    """On 8 GPUs: x's job of 8 GPUs runs 0–1000, y's of 8 GPUs arrives at 100 and runs 1000–1500."""
    jobs = (TraceJob("a", 0.0, 1000.0, 8, tenant="x"), TraceJob("b", 100.0, 500.0, 8, tenant="y"))
    return Simulation(jobs, ClusterShape(1, 8), LIVE_INTERVAL, PolicyName.FIFO, plan).run()


def test_the_figures_of_a_run_checked_by_hand() -> None:
    metrics = measure(_two_jobs_one_after_the_other())
    assert metrics.jobs == 2
    assert metrics.jct_mean_s == pytest.approx(1200.0)  # (1000 + 1400) / 2
    assert metrics.jct_median_s == pytest.approx(1200.0)
    assert metrics.jct_p99_s == pytest.approx(1000.0 + 0.99 * 400.0)  # linear between the two
    assert metrics.wait_mean_s == pytest.approx(450.0)
    assert metrics.longest_wait_s == pytest.approx(900.0)
    assert metrics.makespan_s == pytest.approx(1500.0)
    assert metrics.gpu_utilization == pytest.approx(1.0)
    assert metrics.worst_finish_time_fairness == pytest.approx(1400.0 / 500.0)
    # x used 8000 GPU-seconds, y 4000: (12000)² / (2 · (8000² + 4000²)) = 0.9
    assert metrics.jain_index == pytest.approx(0.9)
    assert metrics.preemptions_per_job == 0.0 and metrics.resizes_per_job == 0.0
    assert metrics.passes >= 2


def test_tenant_weights_scale_their_usage_in_jains_index() -> None:
    jobs = (TraceJob("a", 0.0, 1000.0, 8, tenant="x"), TraceJob("b", 100.0, 500.0, 8, tenant="y"))
    settings = SimulationSettings(scheduling_interval_s=0.5, tenant_weights=(("x", 2.0),))
    run = Simulation(jobs, ClusterShape(1, 8), settings, PolicyName.FIFO, plan).run()
    assert measure(run).jain_index == pytest.approx(1.0)  # x used twice y's, at twice the weight


def test_ratios_against_a_baseline() -> None:
    metrics = measure(_two_jobs_one_after_the_other())
    relative = ratios(metrics, metrics)
    assert relative["jct_mean_s"] == 1.0
    assert relative["preemptions_per_job"] is None  # the baseline's 0: no ratio


def test_the_utilization_timeline_is_time_weighted() -> None:
    timeline = utilization_timeline(_two_jobs_one_after_the_other(), buckets=15)
    assert [round(at) for at, _, _ in timeline] == list(range(0, 1500, 100))
    assert all(held == pytest.approx(1.0) for _, held, _ in timeline)
    # b waits from 100 to 1000: one job queued in the buckets [100, 1000), none after
    assert [queued for _, _, queued in timeline] == pytest.approx([0.0] + [1.0] * 9 + [0.0] * 5)
