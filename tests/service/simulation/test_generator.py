"""Synthetic traces: one seed, one trace; the shape's settings show in what it draws."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from ringmaster.service.simulation.errors import SimulationInputError
from ringmaster.service.simulation.generator import (
    HELIOS_LOAD,
    WorkloadShape,
    expected_duration_s,
    expected_size,
    generate,
    helios_shape,
)
from ringmaster.service.simulation.trace import read_trace, write_trace


def test_the_same_seed_gives_the_same_trace_and_another_seed_another() -> None:
    shape = WorkloadShape(jobs=300, seed=11)
    assert generate(shape) == generate(shape)
    assert generate(shape) != generate(WorkloadShape(jobs=300, seed=12))


def test_a_generated_trace_survives_writing_and_reading(tmp_path: Path) -> None:
    jobs = generate(WorkloadShape(jobs=200, seed=3))
    write_trace(jobs, tmp_path / "synthetic.csv")
    assert read_trace(tmp_path / "synthetic.csv", cluster_gpus=64).jobs == jobs


def test_the_draws_follow_the_shape() -> None:
    shape = WorkloadShape(
        jobs=4000,
        seed=5,
        arrivals_per_hour=120.0,
        size_weights=((1, 1.0), (4, 1.0)),
        duration_median_s=600.0,
        duration_sigma=0.5,
        tenants=("x", "y", "z"),
        elastic_share=0.5,
        high_priority_share=0.25,
    )
    jobs = generate(shape)
    gaps = [later.submit_time - earlier.submit_time for earlier, later in itertools.pairwise(jobs)]
    assert statistics.mean(gaps) == pytest.approx(30.0, rel=0.06)  # 120 an hour: one every 30 s
    assert {job.gpus for job in jobs} == {1, 4}
    assert statistics.median(job.duration for job in jobs) == pytest.approx(600.0, rel=0.06)
    assert {job.tenant for job in jobs} == {"x", "y", "z"}
    four_gpu_jobs = [job for job in jobs if job.gpus == 4]
    elastic = [job for job in four_gpu_jobs if job.elastic]
    assert len(elastic) / len(four_gpu_jobs) == pytest.approx(0.5, abs=0.04)
    assert all(job.min_gpus == 2 for job in elastic)
    assert not any(job.elastic for job in jobs if job.gpus == 1)  # one GPU cannot shrink
    assert sum(job.priority == 1 for job in jobs) / len(jobs) == pytest.approx(0.25, abs=0.03)


@pytest.mark.parametrize(
    "bad",
    [
        {"jobs": 0},
        {"arrivals_per_hour": 0.0},
        {"size_weights": ((0, 1.0),)},
        {"tenants": ()},
        {"elastic_share": 1.5},
    ],
)
def test_a_shape_that_cannot_be_drawn_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(SimulationInputError):
        WorkloadShape(**bad)  # type: ignore[arg-type]


def test_the_helios_preset_draws_helios_published_sizes_durations_and_load() -> None:
    shape = helios_shape(cluster_gpus=64, jobs=20_000, seed=2)
    jobs = generate(shape)
    # sigma from the published median 206 s and mean 6,651.681 s: sqrt(2 ln(6651.681 / 206))
    assert shape.duration_sigma == pytest.approx(2.636, abs=0.001)
    assert statistics.median(job.duration for job in jobs) == pytest.approx(206.0, rel=0.06)
    one_gpu = sum(job.gpus == 1 for job in jobs) / len(jobs)
    assert one_gpu == pytest.approx(0.7219, abs=0.01)  # 72.19 % of Helios's GPU jobs ask for one GPU
    assert sum(job.gpus <= 8 for job in jobs) / len(jobs) == pytest.approx(0.9469, abs=0.006)
    assert max(job.gpus for job in jobs) == 64
    # Its arrival rate loads 64 GPUs as Helios's jobs loaded Helios: 79.3 % of the GPU time.
    offered = shape.arrivals_per_hour / 3600.0 * expected_size(shape) * expected_duration_s(shape) / 64
    assert offered == pytest.approx(HELIOS_LOAD)
    assert round(HELIOS_LOAD, 3) == 0.793
    drawn = sum(job.gpus * job.duration for job in jobs) / len(jobs)
    assert drawn == pytest.approx(expected_size(shape) * expected_duration_s(shape), rel=0.15)


def test_the_expected_duration_is_the_clamped_log_normals_mean() -> None:
    shape = WorkloadShape(jobs=40_000, seed=4, duration_median_s=600.0, duration_sigma=1.0)
    drawn = statistics.mean(job.duration for job in generate(shape))
    assert expected_duration_s(shape) == pytest.approx(drawn, rel=0.03)
    assert expected_duration_s(replace(shape, duration_sigma=0.0)) == 600.0
    assert expected_duration_s(replace(shape, duration_median_s=10.0, duration_sigma=0.0)) == 60.0  # clamped
