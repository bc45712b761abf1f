"""The decayed fair-share ledger: usage fades with the half-life, and a tenant's share is its dominant resource's."""

from __future__ import annotations

import math

import pytest

from ringmaster.service.scheduling.fair_share import FairShareLedger, Held, dominant_share, held_by_tenant
from ringmaster.service.scheduling.model import TenantView
from tests.service.scheduling.snapshots import ONE_CPU, running

CLUSTER = Held(gpus=8.0, cpus=64.0)


def test_share_approaches_the_held_fraction_and_decays_by_half_each_half_life() -> None:
    ledger = FairShareLedger(half_life_s=100.0, start=0.0)
    ledger.record(0.0, {"a": Held(gpus=4.0)}, CLUSTER)  # half the GPUs from t=0
    assert ledger.share("a", 100.0) == pytest.approx(0.5 * (1 - 0.5))
    assert ledger.share("a", 200.0) == pytest.approx(0.5 * (1 - 0.25))
    ledger.record(200.0, {}, CLUSTER)  # released at t=200
    assert ledger.share("a", 300.0) == pytest.approx(0.5 * 0.75 * 0.5)
    assert ledger.share("a", 500.0) == pytest.approx(0.5 * 0.75 * 0.125)
    assert ledger.share("a", 10_000.0) == pytest.approx(0.0, abs=1e-12)


def test_a_long_steady_holding_converges_to_its_fraction() -> None:
    ledger = FairShareLedger(half_life_s=60.0, start=0.0)
    ledger.record(0.0, {"a": Held(gpus=2.0), "b": Held(gpus=6.0)}, CLUSTER)
    shares = ledger.shares(60.0 * 40)
    assert shares["a"] == pytest.approx(0.25) and shares["b"] == pytest.approx(0.75)


def test_recording_in_steps_equals_one_interval() -> None:
    """The decay is exponential in continuous time: recording the same holdings often changes nothing."""
    once, often = FairShareLedger(30.0, 0.0), FairShareLedger(30.0, 0.0)
    once.record(0.0, {"a": Held(gpus=8.0)}, CLUSTER)
    for moment in range(0, 90, 7):
        often.record(float(moment), {"a": Held(gpus=8.0)}, CLUSTER)
    assert often.share("a", 90.0) == pytest.approx(once.share("a", 90.0)) == pytest.approx(1 - 2 ** (-3))


def test_the_dominant_resource_decides() -> None:
    ledger = FairShareLedger(half_life_s=10.0, start=0.0)
    ledger.record(0.0, {"cpu-heavy": Held(gpus=1.0, cpus=48.0)}, CLUSTER)  # 1/8 of the GPUs, 3/4 of the CPUs
    assert ledger.share("cpu-heavy", 10.0) == pytest.approx(0.75 * 0.5)
    assert dominant_share(Held(gpus=1.0, cpus=48.0), CLUSTER) == 0.75
    assert dominant_share(Held(gpus=1.0), Held(gpus=0.0, cpus=4.0)) == 0.0


def test_holdings_come_from_running_jobs_and_fill_tenant_views() -> None:
    jobs = [
        running("g", ["n0", "n1"], tenant="a"),
        running("c", ["n0", "n0"], tenant="b", shape=ONE_CPU),
        running("g2", ["n2"], tenant="a"),
    ]
    holdings = held_by_tenant(jobs)
    assert holdings == {"a": Held(gpus=3.0), "b": Held(cpus=2.0)}
    ledger = FairShareLedger(half_life_s=50.0, start=0.0)
    ledger.record(0.0, holdings, CLUSTER)
    views = ledger.tenant_views([TenantView("a", weight=2.0), TenantView("idle")], now=50.0)
    assert views[0].weight == 2.0 and views[0].decayed_share == pytest.approx(3 / 8 * 0.5)
    assert views[1].decayed_share == 0.0


def test_time_never_goes_back_and_the_half_life_is_positive() -> None:
    ledger = FairShareLedger(half_life_s=10.0, start=100.0)
    with pytest.raises(ValueError, match="backwards"):
        ledger.record(50.0, {}, CLUSTER)
    with pytest.raises(ValueError, match="half_life_s"):
        FairShareLedger(half_life_s=0.0, start=0.0)
    assert math.isclose(ledger.share("nobody", 200.0), 0.0)
