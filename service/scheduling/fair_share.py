"""Each tenant's decayed dominant-resource share of the cluster (Slurm's decayed fair share, measured as in DRF).

The dispatcher and the simulator tell a FairShareLedger what each tenant holds whenever it changes; the ledger keeps,
per tenant and resource, an exponentially decayed average of the share of the cluster held, in which usage `h`
seconds ago weighs 2^(-h / half_life) as much as usage now. A tenant's decayed share is the larger of its GPU and
CPU averages (its dominant resource): 0.5 means it has held half the cluster's dominant resource lately.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from ringmaster.service.scheduling.model import RunningJob, TenantView, WorkerShape


@dataclass(frozen=True, slots=True)
class Held:
    """What a tenant holds on the cluster: a GPU worker's bundle holds its GPUs alone, a CPU worker's its CPUs."""

    gpus: float = 0.0
    cpus: float = 0.0

    def plus(self, other: Held) -> Held:
        return Held(self.gpus + other.gpus, self.cpus + other.cpus)


def held_by_workers(shape: WorkerShape, workers: int) -> Held:
    return Held(gpus=float(shape.gpus * workers)) if shape.gpus > 0 else Held(cpus=shape.cpus * workers)


def held_by_tenant(running: Iterable[RunningJob]) -> dict[str, Held]:
    """Each tenant's holdings from its running jobs: what a ledger is fed after every change."""
    holdings: dict[str, Held] = {}
    for job in running:
        holdings[job.tenant] = holdings.get(job.tenant, Held()).plus(held_by_workers(job.shape, job.workers))
    return holdings


def dominant_share(held: Held, capacity: Held) -> float:
    """The larger of the GPU and CPU fractions of the cluster held (a resource the cluster lacks counts 0)."""
    gpu_share = held.gpus / capacity.gpus if capacity.gpus > 0 else 0.0
    cpu_share = held.cpus / capacity.cpus if capacity.cpus > 0 else 0.0
    return max(gpu_share, cpu_share)


class FairShareLedger:
    """Decayed GPU and CPU shares per tenant over simulated or wall time, fed with piecewise-constant holdings."""

    def __init__(self, half_life_s: float, start: float) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self._decay_rate = math.log(2) / half_life_s
        self._last = start
        self._held: dict[str, Held] = {}  # the holdings since the last record, as fractions of the cluster
        self._averages: dict[str, Held] = {}  # decayed fractions of the cluster as of self._last

    def _advance(self, now: float) -> None:
        """Fold the holdings since the last record into the averages: x ← x·d + h·(1 − d), d = 2^(−Δt/half_life)."""
        if now < self._last:
            raise ValueError(f"time went backwards: {now} < {self._last}")
        kept = math.exp(-self._decay_rate * (now - self._last))
        added = 1.0 - kept
        for tenant in self._averages.keys() | self._held.keys():
            average, held = self._averages.get(tenant, Held()), self._held.get(tenant, Held())
            self._averages[tenant] = Held(
                average.gpus * kept + held.gpus * added, average.cpus * kept + held.cpus * added
            )
        self._last = now

    def record(self, now: float, holdings: Mapping[str, Held], capacity: Held) -> None:
        """From `now` on, each tenant holds what `holdings` says (absent: nothing) of a cluster of `capacity`."""
        self._advance(now)
        self._held = {
            tenant: Held(
                held.gpus / capacity.gpus if capacity.gpus > 0 else 0.0,
                held.cpus / capacity.cpus if capacity.cpus > 0 else 0.0,
            )
            for tenant, held in holdings.items()
        }

    def share(self, tenant: str, now: float) -> float:
        """The tenant's decayed dominant share at `now` (its holdings since the last record count up to now)."""
        return self.shares(now).get(tenant, 0.0)

    def shares(self, now: float) -> dict[str, float]:
        self._advance(now)
        return {tenant: max(average.gpus, average.cpus) for tenant, average in self._averages.items()}

    def tenant_views(self, tenants: Iterable[TenantView], now: float) -> tuple[TenantView, ...]:
        """The tenants with their decayed_share as of `now`, for a SchedulingInput."""
        shares = self.shares(now)
        return tuple(replace(tenant, decayed_share=shares.get(tenant.name, 0.0)) for tenant in tenants)
