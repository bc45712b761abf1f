"""A simulation's settings, each named on the command line as `--setting NAME=VALUE`: the job model's figures, how
often the scheduler plans, the policy's anti-thrash and fair-share settings, and the tenants' weights."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ringmaster.service.scheduling.model import PolicyName, PolicySettings
from ringmaster.service.simulation.errors import SimulationInputError
from ringmaster.service.simulation.job_model import JobModel, Scaling

_POLICY_DEFAULTS = PolicySettings()


@dataclass(frozen=True, slots=True)
class SimulationSettings:
    job_model: JobModel = field(default_factory=JobModel)
    # The least time between two scheduling passes, and how often the plan is asked again while jobs wait with
    # nothing arriving or ending (what it decides may change with time alone: a minimum run time passing, shares
    # decaying). A job that arrives or ends on a cluster not planned for in the last interval is planned for at once,
    # so a job alone starts at its submit time. The live dispatcher plans every RINGMASTER_DISPATCH_INTERVAL_S
    # (0.5 s); a pass costs the same there and here, so a coarser interval keeps a trace of weeks fast, at the price of
    # starts up to this much later after a job ends on a busy cluster, small beside jobs of minutes to days.
    scheduling_interval_s: float = 60.0
    min_run_s: float = _POLICY_DEFAULTS.min_run_s
    min_resize_interval_s: float = _POLICY_DEFAULTS.min_resize_interval_s
    fair_share_half_life_s: float = _POLICY_DEFAULTS.fair_share_half_life_s
    reserve_after_s: float = _POLICY_DEFAULTS.reserve_after_s
    hold_after_s: float = _POLICY_DEFAULTS.hold_after_s
    fair_share_preemption_above: float = _POLICY_DEFAULTS.fair_share_preemption_above
    # Tenant weights for fair share, `tenant_weights=team-a:3,team-b:1`; a tenant not named weighs 1.
    tenant_weights: tuple[tuple[str, float], ...] = field(default=())

    def policy(self, name: PolicyName) -> PolicySettings:
        return PolicySettings(
            name=name,
            min_run_s=self.min_run_s,
            min_resize_interval_s=self.min_resize_interval_s,
            fair_share_half_life_s=self.fair_share_half_life_s,
            reserve_after_s=self.reserve_after_s,
            hold_after_s=self.hold_after_s,
            fair_share_preemption_above=self.fair_share_preemption_above,
        )

    def weight(self, tenant: str) -> float:
        return dict(self.tenant_weights).get(tenant, 1.0)

    def as_dict(self) -> dict[str, Any]:
        """Every setting by the name `--setting` takes, as JSON shows them."""
        values: dict[str, Any] = {name: getattr(self.job_model, name) for name in _JOB_MODEL_NAMES}
        values["scaling"] = str(self.job_model.scaling)
        values.update({name: getattr(self, name) for name in _OWN_NAMES if name != "tenant_weights"})
        values["tenant_weights"] = dict(self.tenant_weights)
        return values


_JOB_MODEL_NAMES = tuple(item.name for item in dataclasses.fields(JobModel))
_OWN_NAMES = tuple(item.name for item in dataclasses.fields(SimulationSettings) if item.name != "job_model")
SETTING_NAMES = _JOB_MODEL_NAMES + _OWN_NAMES


def parse_settings(pairs: list[str]) -> SimulationSettings:
    """Settings from `NAME=VALUE` pairs over the defaults; a bad name or value raises one line naming it."""
    model_changes: dict[str, Any] = {}
    own_changes: dict[str, Any] = {}
    for pair in pairs:
        name, separator, text = (part.strip() for part in pair.partition("="))
        if not separator or not name:
            raise SimulationInputError(f"a setting is NAME=VALUE, got {pair!r}")
        if name not in SETTING_NAMES:
            raise SimulationInputError(f"unknown setting {name!r}; the settings are {', '.join(SETTING_NAMES)}")
        changes = model_changes if name in _JOB_MODEL_NAMES else own_changes
        changes[name] = _value(name, text)
    return SimulationSettings(job_model=dataclasses.replace(JobModel(), **model_changes), **own_changes)


def _value(name: str, text: str) -> Any:
    if name == "scaling":
        try:
            return Scaling(text.lower())
        except ValueError:
            raise SimulationInputError(f"setting scaling is linear or amdahl, got {text!r}") from None
    if name == "tenant_weights":
        return _weights(text)
    try:
        number = float(text)
    except ValueError:
        raise SimulationInputError(f"setting {name} takes a number, got {text!r}") from None
    if not math.isfinite(number) or number < 0:
        raise SimulationInputError(f"setting {name} takes a number ≥ 0, got {text!r}")
    if name == "serial_fraction" and number >= 1:
        raise SimulationInputError(f"setting serial_fraction is below 1, got {text!r}")
    if name in ("scheduling_interval_s", "fair_share_half_life_s") and number == 0:
        raise SimulationInputError(f"setting {name} takes a number > 0, got {text!r}")
    return number


def _weights(text: str) -> tuple[tuple[str, float], ...]:
    weights: list[tuple[str, float]] = []
    for item in text.split(","):
        tenant, separator, weight_text = (part.strip() for part in item.partition(":"))
        try:
            weight = float(weight_text)
        except ValueError:
            weight = math.nan
        if not separator or not tenant or not math.isfinite(weight) or weight <= 0:
            raise SimulationInputError(f"setting tenant_weights is TENANT:WEIGHT,… with weights > 0, got {text!r}")
        weights.append((tenant, weight))
    return tuple(weights)
