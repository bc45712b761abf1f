"""The job model's arithmetic: speed at a world size (linear, Amdahl) and what a preemption throws away."""

from __future__ import annotations

import pytest

from ringmaster.service.simulation.job_model import JobModel, Scaling


def test_linear_speed_is_proportional_to_the_workers() -> None:
    model = JobModel(scaling=Scaling.LINEAR)
    assert model.rate(8, 8) == 1.0
    assert model.rate(4, 8) == 0.5
    assert model.rate(1, 4) == 0.25


def test_amdahl_speed_relative_to_the_requested_size() -> None:
    model = JobModel(scaling=Scaling.AMDAHL, serial_fraction=0.1)
    # speed(n) = 1 / (0.1 + 0.9/n): speed(8) = 1/0.2125, speed(4) = 1/0.325
    assert model.rate(4, 8) == pytest.approx(0.2125 / 0.325)
    assert model.rate(8, 8) == pytest.approx(1.0)
    assert model.rate(2, 1) == pytest.approx(1 / 0.55)  # 2 workers do 1.82× one worker's work, not 2×


def test_a_preempted_job_that_is_not_elastic_loses_what_ran_since_its_last_checkpoint() -> None:
    model = JobModel(checkpoint_interval_s=1800.0)
    assert model.lost_on_preemption(elastic=False, running_s=4000.0) == pytest.approx(400.0)
    assert model.lost_on_preemption(elastic=False, running_s=1000.0) == pytest.approx(1000.0)
    assert model.lost_on_preemption(elastic=True, running_s=4000.0) == 0.0


def test_without_periodic_checkpoints_a_preemption_loses_the_whole_run() -> None:
    model = JobModel(checkpoint_interval_s=0.0)
    assert model.lost_on_preemption(elastic=False, running_s=4000.0) == 4000.0
