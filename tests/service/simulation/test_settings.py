"""`--setting NAME=VALUE`: every name the defaults have, values checked, and a bad one refused in one line."""

from __future__ import annotations

import pytest

from ringmaster.service.scheduling.model import PolicyName
from ringmaster.service.simulation.errors import SimulationInputError
from ringmaster.service.simulation.job_model import Scaling
from ringmaster.service.simulation.settings import SETTING_NAMES, SimulationSettings, parse_settings


def test_settings_override_the_job_model_the_policy_and_the_weights() -> None:
    settings = parse_settings(
        ["scaling=amdahl", "serial_fraction=0.2", "shrink_s=2", "min_run_s=0", "tenant_weights=a:3, b:1"]
    )
    assert settings.job_model.scaling is Scaling.AMDAHL
    assert settings.job_model.serial_fraction == 0.2
    assert settings.job_model.shrink_s == 2.0
    assert settings.policy(PolicyName.FAIR).min_run_s == 0.0
    assert settings.policy(PolicyName.FAIR).name is PolicyName.FAIR
    assert (settings.weight("a"), settings.weight("b"), settings.weight("c")) == (3.0, 1.0, 1.0)


def test_no_settings_are_the_defaults_and_every_one_is_shown() -> None:
    assert parse_settings([]) == SimulationSettings()
    assert set(SimulationSettings().as_dict()) == set(SETTING_NAMES)


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        ("shrink", "a setting is NAME=VALUE"),
        ("speed=3", "unknown setting 'speed'; the settings are scaling, serial_fraction"),
        ("grow_s=fast", "setting grow_s takes a number, got 'fast'"),
        ("grow_s=-1", "setting grow_s takes a number ≥ 0"),
        ("serial_fraction=1", "setting serial_fraction is below 1"),
        ("scheduling_interval_s=0", "setting scheduling_interval_s takes a number > 0"),
        ("scaling=quadratic", "setting scaling is linear or amdahl"),
        ("tenant_weights=a:0", "setting tenant_weights is TENANT:WEIGHT"),
        ("tenant_weights=a", "setting tenant_weights is TENANT:WEIGHT"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(pair: str, message: str) -> None:
    with pytest.raises(SimulationInputError, match=message):
        parse_settings([pair])
