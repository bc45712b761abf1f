"""Tenants and their quotas: how many GPUs, CPUs and concurrent jobs a team's jobs may hold at once.

A quota is checked twice: at submit, where a job whose smallest size could never fit is refused, and at
admission, where the dispatcher grants a queued job the most workers that fit beside what the tenant's
ADMITTED/RUNNING/RECOVERING jobs hold (each counted at its own grant, the most it may grow to).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, select
from sqlalchemy.orm import Session

from ringmaster.service.errors import QUOTA_EXCEEDED, RingmasterError
from ringmaster.service.models import Attempt, Job, Tenant
from ringmaster.service.spec import JobSpec
from ringmaster.service.states import ACTIVE

NAME_PATTERN = r"^[a-z0-9]([a-z0-9._-]{0,62}[a-z0-9])?$"
_NAME = re.compile(NAME_PATTERN)
_CPU_EPSILON = 1e-9  # cpus_per_worker is fractional: sums of them must not fail a quota by rounding
MAX_WEIGHT = 1000.0  # a thousandfold between two teams is already more than any fair share means to grant


class TenantNotFound(RingmasterError):
    def __init__(self, name: str) -> None:
        super().__init__(f"no tenant named {name!r}")
        self.name = name


class InvalidTenant(RingmasterError):
    """A tenant name, quota or weight that cannot be stored; ``field`` names it (name, gpus, cpus, jobs, weight)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Quota:
    """Most a tenant's admitted jobs may hold at once; None is unlimited."""

    gpus: int | None = None
    cpus: float | None = None
    jobs: int | None = None

    @classmethod
    def of(cls, tenant: Tenant) -> Quota:
        return cls(tenant.quota_gpus, tenant.quota_cpus, tenant.quota_jobs)

    @property
    def unlimited(self) -> bool:
        return self.gpus is None and self.cpus is None and self.jobs is None


@dataclass(frozen=True)
class Usage:
    gpus: int = 0
    cpus: float = 0.0
    jobs: int = 0

    def plus(self, other: Usage) -> Usage:
        return Usage(self.gpus + other.gpus, self.cpus + other.cpus, self.jobs + other.jobs)


@dataclass(frozen=True)
class Grant:
    """Admission's answer for a queued job: the most workers it may hold, or why it has to wait."""

    max_workers: int | None
    reason: str | None = None


def footprint(gpus_per_worker: int, cpus_per_worker: float, workers: int) -> Usage:
    """What one job holds at a world size."""
    return Usage(gpus=workers * gpus_per_worker, cpus=workers * cpus_per_worker, jobs=1)


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise InvalidTenant(
            f"tenant name {name!r}: must be 1-64 characters of a-z, 0-9, '.', '_' or '-', "
            "starting and ending with a letter or digit",
            field="name",
        )
    return name


def check_quota(quota: Quota) -> Quota:
    for resource, value in (("gpus", quota.gpus), ("cpus", quota.cpus), ("jobs", quota.jobs)):
        if value is not None and not 0 <= value <= 1_000_000:
            raise InvalidTenant(
                f"quota {resource} must be between 0 and 1000000 (or unset for unlimited), got {value}", field=resource
            )
    return quota


def check_weight(weight: float) -> float:
    if not (0 < weight <= MAX_WEIGHT):  # also refuses NaN
        raise InvalidTenant(f"weight must be above 0 and at most {MAX_WEIGHT:g}, got {weight}", field="weight")
    return weight


def get_tenant(session: Session, name: str, *, lock: bool = False) -> Tenant:
    tenant = session.get(Tenant, name, with_for_update=lock, populate_existing=lock) if len(name) <= 64 else None
    if tenant is None:
        raise TenantNotFound(name)
    return tenant


def list_tenants(session: Session) -> list[Tenant]:
    return list(session.scalars(select(Tenant).order_by(Tenant.name)))


def put_tenant(session: Session, name: str, quota: Quota, *, weight: float | None = None) -> tuple[Tenant, bool]:
    """Create the tenant or replace its quotas, and its fair-share weight when given (a new one's is 1); True when
    it was created."""
    check_quota(quota)
    if weight is not None:
        check_weight(weight)
    tenant = session.get(Tenant, check_name(name), with_for_update=True, populate_existing=True)
    created = tenant is None
    if tenant is None:
        tenant = Tenant(name=name)
        session.add(tenant)
    tenant.quota_gpus, tenant.quota_cpus, tenant.quota_jobs = quota.gpus, quota.cpus, quota.jobs
    if weight is not None:
        tenant.weight = weight
    session.flush()
    return tenant, created


def ensure_tenant(session: Session, name: str) -> tuple[Tenant, bool]:
    """The tenant, created without quotas when missing; True when it was created."""
    tenant = session.get(Tenant, check_name(name))
    if tenant is not None:
        return tenant, False
    return put_tenant(session, name, Quota())


def usage(session: Session, tenant: str, *, exclude_job: str | None = None) -> Usage:
    """What the tenant's admitted jobs hold, each at the most workers its current attempt was granted."""
    query = (
        select(Job.id, Job.spec, Attempt.max_workers)
        .outerjoin(Attempt, and_(Attempt.job_id == Job.id, Attempt.number == Job.attempt))
        .where(Job.tenant == tenant, Job.state.in_([state.value for state in ACTIVE]))
    )
    total = Usage()
    for job_id, spec, max_workers in session.execute(query):
        if job_id == exclude_job:
            continue
        workers: dict[str, Any] = spec.get("workers", {})
        total = total.plus(
            footprint(
                workers.get("gpus_per_worker", 0),
                workers.get("cpus_per_worker", 1.0),
                (max_workers or workers.get("max", 1)) + workers.get("standby", 0),
            )
        )
    return total


def _exceeded(quota: Quota, held: Usage) -> str | None:
    """The first resource held beyond the quota, named; None when all fit."""
    if quota.jobs is not None and held.jobs > quota.jobs:
        return "jobs"
    if quota.gpus is not None and held.gpus > quota.gpus:
        return "gpus"
    if quota.cpus is not None and held.cpus > quota.cpus + _CPU_EPSILON:
        return "cpus"
    return None


def submit_rejections(spec: JobSpec, tenant: Tenant) -> list[dict[str, Any]]:
    """Why the tenant's quota could never hold this job, even alone, as 422 entries; empty when it could."""
    quota, workers = Quota.of(tenant), spec.workers
    # Warm standby workers hold capacity like workers do, so they count against the quota.
    smallest = footprint(workers.gpus_per_worker, workers.cpus_per_worker, workers.min + workers.standby)
    counted = f"workers.min ({workers.min})" + (f" + workers.standby ({workers.standby})" if workers.standby else "")
    errors: list[dict[str, Any]] = []
    if quota.jobs == 0:
        errors.append(
            {
                "type": QUOTA_EXCEEDED,
                "loc": ["workers"],
                "msg": f"tenant {tenant.name!r} has a quota of 0 concurrent jobs: it cannot run any job",
            }
        )
    if quota.gpus is not None and smallest.gpus > quota.gpus:
        errors.append(
            {
                "type": QUOTA_EXCEEDED,
                "loc": ["workers", "min"],
                "input": workers.min,
                "msg": f"{counted} × workers.gpus_per_worker ({workers.gpus_per_worker}) = "
                f"{smallest.gpus} GPUs exceeds tenant {tenant.name!r}'s GPU quota of {quota.gpus}",
            }
        )
    if quota.cpus is not None and smallest.cpus > quota.cpus + _CPU_EPSILON:
        errors.append(
            {
                "type": QUOTA_EXCEEDED,
                "loc": ["workers", "min"],
                "input": workers.min,
                "msg": f"{counted} × workers.cpus_per_worker ({workers.cpus_per_worker:g}) = "
                f"{smallest.cpus:g} CPUs exceeds tenant {tenant.name!r}'s CPU quota of {quota.cpus:g}",
            }
        )
    return errors


def grant(session: Session, job: Job, spec: JobSpec, *, lock: bool = False) -> Grant:
    """The most workers in [min, max] the tenant's quota lets this job hold now, or why none.

    With lock, the tenant's row is locked first so that concurrent dispatchers grant its quota one at a time.
    """
    tenant = get_tenant(session, job.tenant, lock=lock)
    quota = Quota.of(tenant)
    if quota.unlimited:
        return Grant(spec.workers.max)
    held = usage(session, tenant.name, exclude_job=job.id)
    workers = spec.workers
    for size in range(workers.max, workers.min - 1, -1):
        if (
            _exceeded(
                quota, held.plus(footprint(workers.gpus_per_worker, workers.cpus_per_worker, size + workers.standby))
            )
            is None
        ):
            return Grant(size)
    need = footprint(workers.gpus_per_worker, workers.cpus_per_worker, workers.min + workers.standby)
    resource = _exceeded(quota, held.plus(need))
    if resource == "jobs":
        reason = f"tenant {tenant.name!r} already runs {held.jobs} of its {quota.jobs} concurrent job(s)"
    elif resource == "gpus":
        reason = (
            f"tenant {tenant.name!r} holds {held.gpus} of its {quota.gpus} GPU(s); this job needs "
            f"{need.gpus} more at workers.min {workers.min}"
        )
    else:
        reason = (
            f"tenant {tenant.name!r} holds {held.cpus:g} of its {quota.cpus:g} CPU(s); this job needs "
            f"{need.cpus:g} more at workers.min {workers.min}"
        )
    return Grant(None, f"over quota: {reason}")
