"""The order in which a pass considers the queued jobs: priority first under every policy, then each policy's own.

fifo and backfill: oldest first. fair and elastic: among equal priorities, the tenant furthest below its weighted
share goes next (decayed share over weight, plus what this pass has already admitted for it); within a tenant, fair
takes its jobs oldest first, elastic by least attained service as las does (which approximates shortest job first on
heavy-tailed work), a job that has waited reserve_after_s counting as unserved so that it is not passed for ever.
las: Tiresias's discretised least attained service: the fewer GPU-seconds a job has had, the earlier its queue.
Ties fall to submitted_at, then id, so one input always gives one order.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from operator import attrgetter

from ringmaster.service.scheduling.model import PolicyName, QueuedJob, TenantView

_SMALLEST_WEIGHT = 1e-9  # a tenant of weight 0 goes last among its equals, without dividing by zero


def _higher_priority_first(job: QueuedJob) -> int:
    return -job.priority


def las_queue(attained_gpu_seconds: float, thresholds: Sequence[float]) -> int:
    """Which of Tiresias's queues a job's attained service puts it in: 0 below the first threshold, and so on."""
    return bisect.bisect_right(thresholds, attained_gpu_seconds)


class PlanOrder:
    """Iterates the queued jobs in plan order; under fair ordering, charge() tells it what a tenant was just given."""

    def __init__(
        self,
        queued: Sequence[QueuedJob],
        tenants: Mapping[str, TenantView],
        policy: PolicyName,
        las_thresholds: Sequence[float],
        now: float = 0.0,
        reserve_after_s: float = math.inf,
    ) -> None:
        self._queued = queued
        self._tenants = tenants
        self._policy = policy
        self._las_thresholds = las_thresholds
        self._starved_before = now - reserve_after_s  # submitted by then: waited long enough to count as unserved
        self._charged: dict[str, float] = {}

    def charge(self, tenant: str, share: float) -> None:
        """Count a share of the cluster just admitted for a tenant in its standing for the rest of the pass."""
        self._charged[tenant] = self._charged.get(tenant, 0.0) + share

    def standing(self, tenant: str) -> float:
        """Decayed share over weight, with this pass's admissions: the lower, the sooner its next job."""
        view = self._tenants.get(tenant)
        if view is None:
            return self._charged.get(tenant, 0.0)
        return (view.decayed_share + self._charged.get(tenant, 0.0)) / max(view.weight, _SMALLEST_WEIGHT)

    def __iter__(self) -> Iterator[QueuedJob]:
        if self._policy in (PolicyName.FAIR, PolicyName.ELASTIC):
            return self._by_fair_share()
        if self._policy is PolicyName.LAS:
            thresholds = self._las_thresholds
            return iter(
                sorted(
                    self._queued,
                    key=lambda job: (
                        -job.priority,
                        las_queue(job.attained_gpu_seconds, thresholds),
                        job.submitted_at,
                        job.id,
                    ),
                )
            )
        return iter(sorted(sorted(self._queued, key=attrgetter("submitted_at", "id")), key=_higher_priority_first))

    def _least_served_first(self, job: QueuedJob) -> tuple[object, ...]:
        """Elastic's order within a tenant: its attained-service queue (0 once it waited reserve_after_s), then age."""
        starved = job.submitted_at <= self._starved_before
        served = 0 if starved else las_queue(job.attained_gpu_seconds, self._las_thresholds)
        return (served, job.submitted_at, job.id)

    def _by_fair_share(self) -> Iterator[QueuedJob]:
        """Per priority level, merge the tenants' age-ordered queues, taking next from the lowest standing. A tenant
        goes on while its next job still ranks before every other tenant's (no admission raised its standing)."""
        levels: dict[int, dict[str, list[QueuedJob]]] = {}
        for job in self._queued:
            levels.setdefault(job.priority, {}).setdefault(job.tenant, []).append(job)
        by_age: Callable[[QueuedJob], tuple[object, ...]] = attrgetter("submitted_at", "id")
        if self._policy is PolicyName.ELASTIC:
            by_age = self._least_served_first
        for priority in sorted(levels, reverse=True):
            queues = levels[priority]
            for jobs in queues.values():
                jobs.sort(key=by_age)
            if len(queues) == 1:
                yield from next(iter(queues.values()))
                continue
            heads = [
                (self.standing(tenant), jobs[0].submitted_at, jobs[0].id, tenant) for tenant, jobs in queues.items()
            ]
            heapq.heapify(heads)
            start = dict.fromkeys(queues, 0)
            while heads:
                _, _, _, tenant = heapq.heappop(heads)
                jobs = queues[tenant]
                first = start[tenant]
                for index in range(first, len(jobs)):
                    job = jobs[index]
                    if index > first and heads:
                        standing, top = self.standing(tenant), heads[0]
                        if standing > top[0] or (standing == top[0] and (job.submitted_at, job.id) > top[1:3]):
                            start[tenant] = index
                            heapq.heappush(heads, (standing, job.submitted_at, job.id, tenant))
                            break
                    yield job
