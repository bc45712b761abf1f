"""One scheduling pass: from a snapshot of the cluster and the queue to one Plan, with no side effects.

The pass, in order:
1. Drain: workers on a draining (or vanished) node leave it. Under `elastic` a job shrinks off the node while it
   keeps workers.min elsewhere, else it is preempted; the other policies do not resize, so they preempt.
2. Admission, in plan order (ordering.py). A job over its tenant's quota or larger than the idle cluster waits
   with that reason and blocks nobody. A job whose workers.min fit is admitted: at the most that fits under the
   policies that do not resize, at workers.min under `elastic` (step 4 grows it). A job that does not fit may,
   under `elastic` and `las`, take capacity from lower-ranked running jobs (below), and starts only if what they
   give up is enough. Otherwise the first such job of each resource (GPUs, CPUs) is the head of the queue under
   backfill, fair and elastic: every whole bundle of its shape now free is held for it, so the jobs behind it
   take only what it cannot use and never delay it.
3. Taking capacity (elastic): from running jobs of strictly lower priority, or of equal priority whose tenant
   holds more than its weighted share and would still hold at least the taker's tenant's share afterwards
   (borrowing given back). First their elastic slack above workers.min, lowest priority then largest slack
   first, as shrinks; then whole preemptible jobs, lowest priority then newest first. Never a job resized less
   than min_resize_interval_s ago (for a shrink), run less than min_run_s (for a preemption), or the job that
   preempted the taker (no cycles). Takes that turn out unneeded are given back before anything is decided.
   `las` preempts whole jobs of lower priority, or of equal priority in a later attained-service queue.
4. Grow back (elastic): jobs below workers.max, the new ones included, grow in priority order (then the tenant's
   share over weight) into what is left, never into a head's hold, never a job resized this pass.

A pass costs the sorting of the queue plus, per queued job, work independent of the cluster's size: capacity is
counted per distinct free amount (capacity.py); a job like one already turned away since the last change (same
tenant, priority, shape and size) reuses its verdict; and the running jobs a waiting job may take from are kept per
(priority, tenant or queue) with a bound on what they could give, so a take that cannot succeed is refused without
walking them, and one that failed is not tried again for a larger job of the same kind.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ringmaster.service.scheduling.capacity import EPSILON, Pool, workers_in
from ringmaster.service.scheduling.fair_share import Held, dominant_share, held_by_workers
from ringmaster.service.scheduling.model import (
    Admission,
    Plan,
    PolicyName,
    Preemption,
    QueuedJob,
    QueuePosition,
    Resize,
    RunningJob,
    SchedulingInput,
    TenantView,
    WorkerShape,
)
from ringmaster.service.scheduling.ordering import PlanOrder, las_queue

GPU, CPU = 0, 1  # the two pools: a worker's bundle asks for GPUs alone, or CPUs alone
_UNITS = ("GPUs", "CPUs")
_UNBOUNDED = 1 << 62
_RESERVING = frozenset({PolicyName.BACKFILL, PolicyName.FAIR, PolicyName.ELASTIC})
_TAKING = frozenset({PolicyName.ELASTIC, PolicyName.LAS})


def plan(state: SchedulingInput) -> Plan:
    """Decide one pass: which queued jobs start where, which running jobs shrink, grow or are preempted, and why
    every other queued job waits."""
    scheduling_pass = _Pass(state)
    scheduling_pass.drain()
    positions = [
        QueuePosition(job.id, position, scheduling_pass.consider(job))
        for position, job in enumerate(scheduling_pass.order, start=1)
    ]
    if state.policy.name is PolicyName.ELASTIC:
        scheduling_pass.grow()
    return scheduling_pass.result(tuple(positions))


def _amount(amount: float, pool: int) -> str:
    return f"{amount:g} {_UNITS[pool]}"


class _Tenant:
    """A tenant's standing during the pass: its quota footprint (as tenants.py counts it) and what it holds."""

    __slots__ = ("cpus", "gpus", "held_cpus", "held_gpus", "jobs", "limited", "view")

    def __init__(self, view: TenantView) -> None:
        self.view = view
        self.limited = view.quota_gpus is not None or view.quota_cpus is not None or view.quota_jobs is not None
        self.gpus = 0.0  # quota footprint: every worker's gpus and cpus, as the tenant's quota counts them
        self.cpus = 0.0
        self.jobs = 0
        self.held_gpus = 0.0  # on the cluster: a GPU worker's bundle holds GPUs alone, a CPU worker's CPUs alone
        self.held_cpus = 0.0

    def add(self, shape: WorkerShape, workers: int, jobs: int) -> None:
        gpus, cpus = shape.gpus * workers, shape.cpus * workers
        self.gpus += gpus
        self.cpus += cpus
        self.jobs += jobs
        if gpus:  # as fair_share.held_by_workers counts it
            self.held_gpus += gpus
        else:
            self.held_cpus += cpus

    def held(self, minus: Held | None = None) -> Held:
        if minus is None:
            return Held(self.held_gpus, self.held_cpus)
        return Held(self.held_gpus - minus.gpus, self.held_cpus - minus.cpus)


@dataclass(slots=True, eq=False)
class _Running:
    """A running job as the pass has planned it so far."""

    job: RunningJob
    nodes: list[int]  # the node index of each worker it keeps
    pool: int
    need: float
    may_shrink: bool = False  # elastic slack, and no resize within min_resize_interval_s
    may_preempt: bool = False  # preemptible, and past min_run_s
    group: object = None  # with its priority, what decides who may take from it: its tenant, or its las queue
    served_queue: int = 0  # its attained-service queue (las and elastic)
    shrink_rank: tuple[float, float, float, str] = (0.0, 0.0, 0.0, "")  # the order victims give way (_Victims)
    preempt_rank: tuple[float, float, float, str] = (0.0, 0.0, 0.0, "")
    leaving: list[int] = field(default_factory=list)
    added: list[int] = field(default_factory=list)
    preempted: bool = False
    for_job: str | None = None
    resized: bool = False  # shrunk this pass: it grows no sooner than its resize interval allows
    protected_until: list[float] = field(default_factory=list)  # when its resize interval or minimum run time ends

    def can_give(self) -> float:
        """The most it could give up: all of it if it may be preempted, else its slack."""
        if self.preempted:
            return 0.0
        if self.may_preempt:
            return len(self.nodes) * self.need
        if self.may_shrink:
            return max(len(self.nodes) - self.job.min_workers, 0) * self.need
        return 0.0


@dataclass(slots=True, eq=False)
class _Admitted:
    job: QueuedJob
    nodes: list[int]
    upper: int  # the most it may grow to this pass: workers.max within its tenant's quota at admission
    pool: int
    need: float


class _Victims:
    """One pool's running jobs that waiting jobs may take from, kept per (priority, group) — the group is the tenant
    under elastic, the attained-service queue under las — so a taker walks only the lists it may take from, each in
    the order its jobs give way, and learns what they could give at most without walking them."""

    def __init__(self, running: list[_Running], served_first: bool) -> None:
        self.shrinkable: dict[tuple[int, object], list[_Running]] = {}
        self.preemptible: dict[tuple[int, object], list[_Running]] = {}
        self.fronts: dict[int, int] = {}  # id(list) → the index of its first job with something left to give
        self.given: dict[int, tuple[float, float]] = {}  # id(job) → its can_give() and slack as counted in bounds
        self.bounds: dict[tuple[int, object], float] = {}
        self.slack: dict[tuple[int, object], float] = {}  # what the group's jobs could give by shrinking alone
        for job in running:
            if not (job.may_shrink or job.may_preempt):
                continue
            key = (job.job.priority, job.group)
            # Elastic slack: lowest priority, then largest slack first. Whole jobs: under las the most served first;
            # under elastic the newest first, which loses the least work.
            if job.may_shrink:
                slack = job.job.workers - job.job.min_workers
                job.shrink_rank = (job.job.priority, -slack, -job.job.started_at, job.job.id)
                self.shrinkable.setdefault(key, []).append(job)
            if job.may_preempt:
                served = -job.job.attained_gpu_seconds if served_first else 0.0
                job.preempt_rank = (job.job.priority, served, -job.job.started_at, job.job.id)
                self.preemptible.setdefault(key, []).append(job)
            self.update(job)
        for jobs in self.shrinkable.values():
            jobs.sort(key=lambda r: r.shrink_rank)
        for jobs in self.preemptible.values():
            jobs.sort(key=lambda r: r.preempt_rank)

    def update(self, job: _Running) -> None:
        before = self.given.get(id(job), (0.0, 0.0))
        slack = 0.0
        if job.may_shrink and not job.preempted:
            slack = max(len(job.nodes) - job.job.min_workers, 0) * job.need
        now = (job.can_give(), slack)
        if before != now:
            key = (job.job.priority, job.group)
            self.bounds[key] = self.bounds.get(key, 0.0) - before[0] + now[0]
            self.slack[key] = self.slack.get(key, 0.0) - before[1] + now[1]
            self.given[id(job)] = now

    def could_give(self, keys: list[tuple[int, object]]) -> float:
        return sum(self.bounds.get(key, 0.0) for key in keys)

    def _walk(self, jobs: list[_Running], exhausted: Callable[[_Running], bool]) -> Iterator[_Running]:
        front = self.fronts.get(id(jobs), 0)
        while front < len(jobs) and exhausted(jobs[front]):
            front += 1
        self.fronts[id(jobs)] = front
        return (jobs[index] for index in range(front, len(jobs)))

    def shrinkable_jobs(self, keys: list[tuple[int, object]]) -> Iterator[_Running]:
        lists = [self._walk(self.shrinkable[key], _no_slack) for key in keys if key in self.shrinkable]
        return heapq.merge(*lists, key=lambda r: r.shrink_rank)

    def preemptible_jobs(self, keys: list[tuple[int, object]]) -> Iterator[_Running]:
        lists = [self._walk(self.preemptible[key], _gone) for key in keys if key in self.preemptible]
        return heapq.merge(*lists, key=lambda r: r.preempt_rank)


def _no_slack(job: _Running) -> bool:
    return job.preempted or len(job.nodes) <= job.job.min_workers


def _gone(job: _Running) -> bool:
    return job.preempted


@dataclass(slots=True)
class _Trial:
    """The capacity a waiting job would take: single workers shrunk away, and whole jobs preempted."""

    count: int  # workers of the taker's shape that would fit
    extra: dict[int, float] = field(default_factory=dict)  # amount freed per node
    shrinks: list[tuple[_Running, int]] = field(default_factory=list)
    preemptions: list[_Running] = field(default_factory=list)
    freed: dict[str, Held] = field(default_factory=dict)  # tenant → what its jobs give up
    passed_over: bool = False  # the job the taker made way for was among the victims, and was left alone


class _Pass:
    def __init__(self, state: SchedulingInput) -> None:
        self.now = state.now
        self.settings = state.policy
        self.policy = state.policy.name
        self.las = self.policy is PolicyName.LAS
        self.served = self.las or self.policy is PolicyName.ELASTIC  # orders and preempts by attained service
        self.node_ids = [node.id for node in state.nodes]
        index = {node.id: position for position, node in enumerate(state.nodes)}
        for job in state.running:  # a node a running job is on that the snapshot lacks: gone, so left like a drain
            for node in job.nodes:
                if node not in index:
                    index[node] = len(self.node_ids)
                    self.node_ids.append(node)
        placeable = [node.drain_deadline is None for node in state.nodes]
        self.pools = (
            Pool([node.free_gpus for node in state.nodes], placeable),
            Pool([node.free_cpus for node in state.nodes], placeable),
        )
        self.idle = (
            Pool([node.total_gpus for node in state.nodes], placeable),
            Pool([node.total_cpus for node in state.nodes], placeable),
        )
        self.capacity = Held(
            float(sum(node.total_gpus for node in state.nodes if node.drain_deadline is None)),
            sum(node.total_cpus for node in state.nodes if node.drain_deadline is None),
        )
        self.tenants = {view.name: _Tenant(view) for view in state.tenants}
        self.running = self._running_jobs(state.running, index)
        self.running_by_id = {running.job.id: running for running in self.running}
        active = {job.tenant for job in state.queued} | {job.tenant for job in state.running}
        weights = sum(max(self.tenant(name).view.weight, 0.0) for name in active)
        self.fair_standing = 1.0 / weights if weights > 0 else 0.0  # share over weight of a tenant at its share
        self.order = PlanOrder(
            state.queued,
            {name: tenant.view for name, tenant in self.tenants.items()},
            self.policy,
            self.settings.las_thresholds_gpu_s,
            now=self.now,
            reserve_after_s=self.settings.reserve_after_s if self.policy is PolicyName.ELASTIC else math.inf,
        )
        self.admitted: list[_Admitted] = []
        self.shrunk: list[_Running] = []
        self.grown: list[_Running] = []
        self.preempted: list[_Running] = []
        self.heads: list[str | None] = [None, None]  # the head of the queue per pool: its first job that does not fit
        # The job the free capacity is held for per pool: the head under backfill and fair; under elastic the first job
        # that does not fit once it has waited reserve_after_s (until then the jobs behind use what it cannot).
        self.holders: list[str | None] = [None, None]
        self.claimed = [False, False]  # per pool: a job that waited reserve_after_s claimed room and did not start
        # Under elastic, per pool: the claim the free capacity is held for (its job, its bundle, and whether its wait is
        # bounded: _frees_soon), and whether the hold is applied yet. It is applied before the first work that must
        # not use the capacity (_holds_back); until then preemptible work uses it rather than leave it idle.
        self.soft_holds: list[tuple[QueuedJob, float, bool] | None] = [None, None]
        self.hold_applied = [False, False]
        self.victims: list[_Victims | None] = [None, None]  # built when a job first tries to take from a pool
        # Per pool and (priority, group): the jobs that may not give way yet, as (until when, job id), soonest first.
        self.protected: list[dict[tuple[int, object], list[tuple[float, str]]] | None] = [None, None]
        self.reasons: dict[tuple[object, ...], str] = {}
        self.version = 0  # counts the changes to capacity and usage: a verdict reached in one version holds in it
        self.verdicts: dict[tuple[object, ...], tuple[int, str]] = {}
        self.failed_takes: dict[tuple[object, ...], tuple[int, str]] = {}

    def _running_jobs(self, jobs: tuple[RunningJob, ...], index: dict[str, int]) -> list[_Running]:
        """The running jobs as the pass plans them, counted in their tenants' usage, each marked with whether it may
        give up slack or be preempted now and the group that decides who may take from it."""
        elastic, taking = self.policy is PolicyName.ELASTIC, self.policy in _TAKING
        earliest_start = self.now - self.settings.min_run_s
        latest_resize = self.now - self.settings.min_resize_interval_s
        thresholds = self.settings.las_thresholds_gpu_s
        planned = []
        for job in jobs:
            shape = job.shape
            pool, need = (GPU, float(shape.gpus)) if shape.gpus > 0 else (CPU, shape.cpus)
            running = _Running(job, [index[node] for node in job.nodes], pool, need)
            (self.tenants.get(job.tenant) or self.tenant(job.tenant)).add(shape, len(job.nodes), 1)
            if elastic:
                running.group = job.tenant
                if len(job.nodes) > job.min_workers:
                    if job.last_resized_at is None or job.last_resized_at <= latest_resize:
                        running.may_shrink = True
                    else:
                        running.protected_until.append(job.last_resized_at + self.settings.min_resize_interval_s)
            if taking and job.preemptible:
                if job.started_at <= earliest_start:
                    running.may_preempt = True
                else:
                    running.protected_until.append(job.started_at + self.settings.min_run_s)
            if self.served:
                running.served_queue = las_queue(job.attained_gpu_seconds, thresholds)
            if self.las:
                running.group = running.served_queue
            planned.append(running)
        return planned

    def tenant(self, name: str) -> _Tenant:
        tenant = self.tenants.get(name)
        if tenant is None:
            tenant = self.tenants[name] = _Tenant(TenantView(name))
        return tenant

    def standing(self, held: Held, tenant: _Tenant) -> float:
        """Dominant share of the cluster over weight: 1/Σweights means exactly its weighted share."""
        return dominant_share(held, self.capacity) / max(tenant.view.weight, 1e-9)

    # --- 1. drain -------------------------------------------------------------------------------------------------

    def drain(self) -> None:
        gone = {node for node in range(len(self.node_ids)) if not self.pools[GPU].placeable(node)}
        if not gone:
            return
        for running in self.running:
            if gone.isdisjoint(running.nodes):
                continue
            leaving = [node for node in running.nodes if node in gone]
            staying = len(running.nodes) - len(leaving)
            if self.policy is PolicyName.ELASTIC and staying >= running.job.min_workers:
                for node in leaving:
                    self._shrink_worker(running, node, None)
            else:
                self._preempt(running, None)

    # --- 2. admission ---------------------------------------------------------------------------------------------

    def consider(self, job: QueuedJob) -> str:
        """Admit the job or say why it waits ("" when admitted). A job like one already turned away since the last
        change (same tenant, priority, shape, size, and job it made way for) waits for the same reason."""
        shape = job.shape
        queue = las_queue(job.attained_gpu_seconds, self.settings.las_thresholds_gpu_s) if self.served else 0
        blocker = self._blocker(job) if job.preempted_for is not None else None
        claim = job.submitted_at if self._claims(job) else None
        pool_index = GPU if shape.gpus > 0 else CPU
        held = self._holds_back(pool_index, job.preemptible)  # whether a claim's hold keeps this job from its GPUs
        kind = (job.tenant, job.priority, shape.gpus, shape.cpus, job.min_workers, blocker, queue, claim, held)
        known = self.verdicts.get(kind)
        if known is not None and known[0] == self.version:
            return known[1]
        version = self.version
        reason = self._decide(job)
        if reason and version == self.version:
            self.verdicts[kind] = (version, reason)
        return reason

    def _blocker(self, job: QueuedJob) -> str | None:
        """The job this one made way for, where it could matter: a running job it might otherwise take from."""
        blocker = self.running_by_id.get(job.preempted_for) if job.preempted_for is not None else None
        if blocker is None or blocker.preempted or blocker.job.priority > job.priority:
            return None
        return blocker.job.id

    def _claims(self, job: QueuedJob) -> bool:
        """Under elastic, whether the job would take room from younger jobs of its priority, and hold what is free, if
        it does not fit: it has waited reserve_after_s and nothing is held yet in its pool."""
        if self.policy is not PolicyName.ELASTIC or self.now - job.submitted_at < self.settings.reserve_after_s:
            return False
        return not self.claimed[GPU if job.shape.gpus > 0 else CPU]

    def _decide(self, job: QueuedJob) -> str:
        shape = job.shape
        pool_index, need = (GPU, float(shape.gpus)) if shape.gpus > 0 else (CPU, shape.cpus)
        tenant = self.tenants.get(job.tenant) or self.tenant(job.tenant)
        room = _UNBOUNDED
        if tenant.limited:
            room, over_quota = self._quota_room(tenant, shape, new_job=True, min_workers=job.min_workers)
            if room < job.min_workers:
                return over_quota
        idle = self.idle[pool_index].workers_fitting(need)
        if idle < job.min_workers:
            return (
                f"the cluster's nodes hold only {idle} workers of {_amount(need, pool_index)} each even when idle; "
                f"it needs {job.min_workers}: it waits for nodes to join"
            )
        pool = self.pools[pool_index]
        if self._holds_back(pool_index, job.preemptible):
            self._apply_hold(pool_index)
        fitting = pool.workers_fitting(need)
        upper = min(job.max_workers, room)
        if fitting >= job.min_workers:
            size = job.min_workers if self.policy is PolicyName.ELASTIC else min(upper, fitting)
            self._admit(job, size, upper, pool_index, need)
            return ""
        note = ""
        claim = self._claims(job)
        if self.policy in _TAKING:
            taken = self._take_from_lower(job, pool_index, need, fitting, upper, claim)
            if taken is None:
                return ""
            note = taken
        head = self.heads[pool_index]
        if self.policy in _RESERVING and (head is None or claim):
            self.claimed[pool_index] = self.claimed[pool_index] or claim
            holds = self.policy is not PolicyName.ELASTIC or (
                claim and self.now - job.submitted_at >= self.settings.hold_after_s
            )
            if holds:
                self.holders[pool_index] = job.id
                if self.policy is PolicyName.ELASTIC:
                    self.soft_holds[pool_index] = (job, need, self._frees_soon(job, pool_index, need, fitting))
                else:
                    pool.hold_back(need)
            self.heads[pool_index] = head or job.id
            self.version += 1
            short = _amount((job.min_workers - fitting) * need, pool_index)
            if head is None:
                return f"reserved: head of the queue, waits for {short} more to free{note}"
            if holds:
                soft = self.soft_holds[pool_index]
                held_from = "" if soft is None or soft[2] else " from jobs that cannot be preempted"
                return (
                    f"reserved: waited over {self.settings.hold_after_s:g} s, the free {_UNITS[pool_index]} are held "
                    f"for it{held_from}; waits for {short} more to free{note}"
                )
        holder = self.holders[pool_index]
        if self.soft_holds[pool_index] is not None and not self.hold_applied[pool_index]:
            holder = None  # the claim's hold is not applied to this job: it may use whatever is free
        reason_key = (pool_index, need, job.min_workers, fitting, holder, note)
        reason = self.reasons.get(reason_key)
        if reason is None:
            wanted = f"waiting for {_amount(job.min_workers * need, pool_index)}"
            if holder is not None:
                units = _UNITS[pool_index]
                held_for = f"waiting over {self.settings.hold_after_s:g} s"
                where = "at the head of the queue" if holder == head else held_for
                reason = f"{wanted}, behind job {holder} {where}, for which the free {units} are held"
            else:
                reason = f"{wanted}; {fitting} such workers fit now"
            reason = self.reasons[reason_key] = reason + note
        return reason

    def _holds_back(self, pool_index: int, preemptible: bool | None) -> bool:
        """Whether the pool's claim holds its capacity back from this work: a queued job (preemptible True or False) or
        a running job's growth (None). From everything when its wait is bounded (_frees_soon); when it is not, only
        from jobs that nobody could take back (not preemptible): preemptible work and growth use what would otherwise
        stand idle for a time nobody knows, and give way (preempted or shrunk) once the claim's wait is bounded."""
        soft = self.soft_holds[pool_index]
        return soft is not None and (soft[2] or preemptible is False)

    def _frees_soon(self, job: QueuedJob, pool_index: int, need: float, fitting: int) -> bool:
        """Whether a claim that cannot start could once the jobs it may take from have run out their protection
        (min_run_s, min_resize_interval_s): a wait the plan can bound. Running jobs' remaining time is unknown, so
        capacity the claim waits on beyond those is no reason to hold GPUs idle."""
        trial, could = _Trial(count=0), float(fitting) * need
        for running in self.running:
            if running.pool != pool_index:
                continue
            kind = self._victim_kind(job, running, trial, True, frozenset())
            if kind == "lower" and running.job.preemptible:
                could += len(running.nodes) * running.need
            elif kind is not None:
                could += max(len(running.nodes) - running.job.min_workers, 0) * running.need
            if workers_in(could, need) >= job.min_workers:
                return True
        return False

    def _apply_hold(self, pool_index: int) -> None:
        """Hold the free capacity for the pool's claim from here on in the pass."""
        soft = self.soft_holds[pool_index]
        if soft is None or self.hold_applied[pool_index]:
            return
        self.hold_applied[pool_index] = True
        if self.pools[pool_index].hold_back(soft[1]) > 0:
            self.version += 1

    def _quota_room(self, tenant: _Tenant, shape: WorkerShape, new_job: bool, min_workers: int = 1) -> tuple[int, str]:
        """The most workers of this shape the tenant's quota still allows, and the reason when that is fewer than
        min_workers (worded as the service's own quota check words it, service/tenants.py)."""
        view, name = tenant.view, tenant.view.name
        if new_job and view.quota_jobs is not None and tenant.jobs >= view.quota_jobs:
            return (
                0,
                f"over quota: tenant {name!r} already runs {tenant.jobs} of its {view.quota_jobs} concurrent job(s)",
            )
        room, reason = _UNBOUNDED, ""
        needs = f"; this job needs {{}} more at workers.min {min_workers}"
        if view.quota_gpus is not None and shape.gpus > 0:
            fits = workers_in(max(view.quota_gpus - tenant.gpus, 0.0), shape.gpus)
            if fits < room:
                room = fits
                reason = (
                    f"over quota: tenant {name!r} holds {tenant.gpus:g} of its {view.quota_gpus} GPU(s)"
                    + needs.format(shape.gpus * min_workers)
                )
        if view.quota_cpus is not None and shape.cpus > 0:
            fits = workers_in(max(view.quota_cpus - tenant.cpus, 0.0), shape.cpus)
            if fits < room:
                room = fits
                reason = f"over quota: tenant {name!r} holds {tenant.cpus:g} of its {view.quota_cpus:g} CPU(s)" + (
                    needs.format(f"{shape.cpus * min_workers:g}")
                )
        return room, reason

    def _admit(self, job: QueuedJob, size: int, upper: int, pool_index: int, need: float) -> None:
        nodes = self.pools[pool_index].place(need, size)
        self.tenant(job.tenant).add(job.shape, size, 1)
        self.admitted.append(_Admitted(job, nodes, upper, pool_index, need))
        self.order.charge(job.tenant, dominant_share(held_by_workers(job.shape, size), self.capacity))
        self.version += 1

    # --- 3. taking capacity from lower-ranked jobs ----------------------------------------------------------------

    def _take_from_lower(
        self, job: QueuedJob, pool_index: int, need: float, fitting: int, upper: int, claim: bool = False
    ) -> str | None:
        """Admit the job on capacity that lower-ranked running jobs give up, or say what stops it (None: admitted).
        A claim (elastic, waited reserve_after_s) may also take from the younger jobs of its priority."""
        queue = las_queue(job.attained_gpu_seconds, self.settings.las_thresholds_gpu_s) if self.served else 0
        # Under las who may be taken from does not depend on the tenant; the job it made way for only narrows it.
        failure_key = (
            pool_index,
            need,
            job.priority,
            None if self.las else job.tenant,
            queue,
            job.submitted_at if claim else None,
        )
        for key in (failure_key, (*failure_key, self._blocker(job))):
            failed = self.failed_takes.get(key)
            if failed is not None and job.min_workers >= failed[0]:
                return failed[1]  # what could not free room for fewer workers cannot for more
        victims = self.victims[pool_index]
        if victims is None:
            victims = self.victims[pool_index] = _Victims(
                [running for running in self.running if running.pool == pool_index and not running.preempted],
                served_first=self.las,
            )
        trial = _Trial(count=fitting)
        taker = self.tenant(job.tenant)
        taker_after = self.standing(taker.held().plus(held_by_workers(job.shape, job.min_workers)), taker)
        shrink_keys, keys, could_give, borrowers = self._victim_keys(
            job, victims, queue, pool_index, taker_after, claim
        )
        at_most = workers_in(could_give + self.pools[pool_index].total_free, need)
        if at_most >= job.min_workers:
            if not self.las:
                self._trial_shrinks(
                    job, trial, victims.shrinkable_jobs(shrink_keys), need, taker_after, claim, borrowers
                )
            if trial.count < job.min_workers:
                self._trial_preemptions(job, trial, victims.preemptible_jobs(keys), need, taker_after, claim, borrowers)
        if trial.count < job.min_workers:
            note = self._protected_note(job, pool_index, queue)
            room = trial.count if at_most >= job.min_workers else at_most
            if room > fitting:
                note = f"; lower-ranked jobs could make room for at most {room} of its {job.min_workers} workers{note}"
            self.failed_takes[(*failure_key, self._blocker(job)) if trial.passed_over else failure_key] = (
                job.min_workers,
                note,
            )
            return note
        self._give_back_unneeded(trial, job.min_workers, pool_index, need)
        for victim in trial.preemptions:
            self._preempt(victim, job.id)
        for victim, node in trial.shrinks:
            if not victim.preempted:
                self._shrink_worker(victim, node, job.id)
        fits_now = self.pools[pool_index].workers_fitting(need)
        size = job.min_workers if self.policy is PolicyName.ELASTIC else min(upper, fits_now)
        self._admit(job, size, upper, pool_index, need)
        return None

    def _victim_keys(
        self, job: QueuedJob, victims: _Victims, queue: int, pool_index: int, taker_after: float, claim: bool
    ) -> tuple[list[tuple[int, object]], list[tuple[int, object]], float, frozenset[str]]:
        """The (priority, group)s the taker may shrink, those it may preempt from, an upper bound of what they could
        give, and the tenants it may take from as borrowers. Every lower priority. At its own: under las the queues
        of more attained service; under elastic every job's slack above workers.min, whole jobs of the tenants above
        their weighted share (a borrower gives no more than keeps its standing at the taker's), and on a claim whole
        jobs younger than the taker (_victim_kind picks them out)."""
        shrink_keys: list[tuple[int, object]] = []
        keys: list[tuple[int, object]] = []
        borrowers: set[str] = set()
        could_give = 0.0
        elastic = self.policy is PolicyName.ELASTIC
        for key, amount in victims.bounds.items():
            priority, group = key
            if priority < job.priority or (
                self.las and priority == job.priority and isinstance(group, int) and group > queue
            ):
                keys.append(key)
                shrink_keys.append(key)
                could_give += amount
            elif elastic and priority == job.priority:
                shrink_keys.append(key)
                if claim:  # _victim_kind keeps those ranked after the taker
                    keys.append(key)
                    could_give += amount
                    continue
                lender = self.tenant(str(group))
                if group != job.tenant and self.standing(lender.held(), lender) > self.fair_standing + EPSILON:
                    keys.append(key)
                    borrowers.add(str(group))
                    could_give += min(amount, self._lendable(lender, pool_index, taker_after))
                else:
                    could_give += victims.slack.get(key, 0.0)
        return shrink_keys, keys, could_give, frozenset(borrowers)

    def _lendable(self, lender: _Tenant, pool_index: int, taker_after: float) -> float:
        """The most of this pool's resource a borrower could give while its standing stays at least taker_after."""
        weight = max(lender.view.weight, 1e-9)
        held = (lender.held_gpus, lender.held_cpus)
        capacity = (self.capacity.gpus, self.capacity.cpus)
        other = 1 - pool_index
        if capacity[other] > 0 and held[other] / capacity[other] / weight >= taker_after - EPSILON:
            return _UNBOUNDED  # its other resource alone keeps its standing
        return max(held[pool_index] - taker_after * weight * capacity[pool_index], 0.0)

    def _victim_kind(
        self, job: QueuedJob, victim: _Running, trial: _Trial, claim: bool, borrowers: frozenset[str]
    ) -> str | None:
        """'lower' for a job of lower priority (or, under las, in a later queue). At equal priority under elastic:
        'lower' on a claim for one ranked after the taker (in a later attained-service queue, or the same and submitted
        after it), whatever its tenant; else nothing from the taker's own tenant, 'borrower' for another tenant's job
        whose share decides, 'slack' for one that may only shrink. None for one it may not take from."""
        if victim.preempted or not victim.nodes:
            return None
        if victim.job.id == job.preempted_for:
            trial.passed_over = True
            return None
        if victim.job.priority < job.priority or self.las:
            return "lower"
        thresholds = self.settings.las_thresholds_gpu_s
        taker_queue, victim_queue = las_queue(job.attained_gpu_seconds, thresholds), victim.served_queue
        if claim:
            submitted = victim.job.submitted_at if victim.job.submitted_at is not None else victim.job.started_at
            if victim_queue > taker_queue or (victim_queue == taker_queue and submitted > job.submitted_at):
                return "lower"
        if victim.job.tenant == job.tenant:
            return None  # a tenant's own jobs of one priority do not take turns
        if victim.job.tenant in borrowers:
            return "borrower"
        return "slack"

    def _keeps_standing(self, trial: _Trial, victim: _Running, freed: Held, taker_after: float) -> bool:
        """Whether the victim's tenant, giving this up too, still holds at least the taker's tenant's standing."""
        owner = self.tenant(victim.job.tenant)
        already = trial.freed.get(owner.view.name, Held())
        return taker_after <= self.standing(owner.held(already.plus(freed)), owner) + EPSILON

    def _may_borrow(self, trial: _Trial, victim: _Running, freed: Held, taker_after: float) -> bool:
        """An equal-priority victim gives way only while its tenant holds more than its weighted share, and still holds
        at least the taker's tenant's standing (with the new job) afterwards, so the two cannot take turns."""
        owner = self.tenant(victim.job.tenant)
        if self.standing(owner.held(), owner) <= self.fair_standing + EPSILON:
            return False
        already = trial.freed.get(owner.view.name, Held())
        return taker_after <= self.standing(owner.held(already.plus(freed)), owner) + EPSILON

    def _far_above_share(self, victim: _Running) -> bool:
        """Stopping a job loses its work since its checkpoint where shrinking loses nothing: for fair share alone a
        tenant's job is preempted only while the tenant holds over fair_share_preemption_above × its weighted share."""
        owner = self.tenant(victim.job.tenant)
        bound = self.fair_standing * self.settings.fair_share_preemption_above
        return self.standing(owner.held(), owner) > bound + EPSILON

    def _protected_note(self, job: QueuedJob, pool_index: int, queue: int) -> str:
        """When the soonest running job the taker could take from, but may not yet, gives way."""
        protected = self.protected[pool_index]
        if protected is None:
            protected = self.protected[pool_index] = {}
            for running in self.running:
                if running.pool == pool_index and running.protected_until and not running.preempted:
                    for until in running.protected_until:
                        protected.setdefault((running.job.priority, running.group), []).append((until, running.job.id))
            for entries in protected.values():
                entries.sort()
        soonest: tuple[float, str] | None = None
        for (priority, group), entries in protected.items():
            if priority > job.priority:
                continue
            if priority == job.priority and not (
                (self.las and isinstance(group, int) and group > queue)
                or (self.policy is PolicyName.ELASTIC and group != job.tenant)
            ):
                continue
            for until, job_id in entries:
                if job_id != job.preempted_for:
                    if soonest is None or (until, job_id) < soonest:
                        soonest = (until, job_id)
                    break
        if soonest is None:
            return ""
        return f"; job {soonest[1]} may give way in {soonest[0] - self.now:.0f} s"

    def _gain(self, trial: _Trial, node: int, amount: float, need: float, pool: Pool) -> int:
        if not pool.placeable(node):
            return 0
        before = pool.free[node] + trial.extra.get(node, 0.0)
        return workers_in(before + amount, need) - workers_in(before, need)

    def _free_in_trial(self, trial: _Trial, victim: _Running, nodes: list[int], need: float) -> None:
        pool = self.pools[victim.pool]
        for node in nodes:
            trial.count += self._gain(trial, node, victim.need, need, pool)
            trial.extra[node] = trial.extra.get(node, 0.0) + victim.need
        owner = victim.job.tenant
        trial.freed[owner] = trial.freed.get(owner, Held()).plus(held_by_workers(victim.job.shape, len(nodes)))

    def _trial_shrinks(
        self,
        job: QueuedJob,
        trial: _Trial,
        victims: Iterator[_Running],
        need: float,
        taker_after: float,
        claim: bool,
        borrowers: frozenset[str],
    ) -> None:
        """Take single workers above workers.min, each from the node where it completes the most bundles: slack is
        lent, so any job of the taker's priority or lower gives it back; another tenant's job of equal priority only
        while its tenant keeps at least the taker's standing (so the two cannot take turns), unless on a claim. A
        tenant that may give no more is passed over for the rest of the trial."""
        refused: set[str] = set()
        for victim in victims:
            kind = self._victim_kind(job, victim, trial, claim, borrowers)
            slack = len(victim.nodes) - victim.job.min_workers
            if kind is None or slack <= 0 or victim.job.tenant in refused:
                continue
            lent = kind != "lower" and victim.job.tenant != job.tenant
            pool = self.pools[victim.pool]
            remaining = dict.fromkeys(victim.nodes, 0)
            for node in victim.nodes:
                remaining[node] += 1
            one_worker = held_by_workers(victim.job.shape, 1)
            for _ in range(slack):
                if lent and not self._keeps_standing(trial, victim, one_worker, taker_after):
                    refused.add(victim.job.tenant)
                    break
                node = max(
                    (node for node, count in remaining.items() if count > 0),
                    key=lambda node: (
                        self._gain(trial, node, victim.need, need, pool),
                        pool.free[node] + trial.extra.get(node, 0.0) if pool.placeable(node) else -1.0,
                    ),
                )
                remaining[node] -= 1
                self._free_in_trial(trial, victim, [node], need)
                trial.shrinks.append((victim, node))
                if trial.count >= job.min_workers:
                    return

    def _trial_preemptions(
        self,
        job: QueuedJob,
        trial: _Trial,
        victims: Iterator[_Running],
        need: float,
        taker_after: float,
        claim: bool,
        borrowers: frozenset[str],
    ) -> None:
        """Take whole preemptible jobs that have run their minimum run time."""
        for victim in victims:
            kind = self._victim_kind(job, victim, trial, claim, borrowers)
            if kind is None or kind == "slack":
                continue
            nodes = list(victim.nodes)
            for shrunk, node in trial.shrinks:
                if shrunk is victim:
                    nodes.remove(node)
            if kind == "borrower" and not (
                self._far_above_share(victim)
                and self._may_borrow(trial, victim, held_by_workers(victim.job.shape, len(nodes)), taker_after)
            ):
                continue
            self._free_in_trial(trial, victim, nodes, need)
            trial.preemptions.append(victim)
            if trial.count >= job.min_workers:
                return

    def _give_back_unneeded(self, trial: _Trial, workers: int, pool_index: int, need: float) -> None:
        """Undo, newest first, the preemptions and then the shrinks the job can start without."""
        pool = self.pools[pool_index]

        def loss(victim: _Running, nodes: list[int]) -> int:
            lost, returned = 0, dict.fromkeys(nodes, 0.0)
            for node in nodes:
                if pool.placeable(node):
                    before = pool.free[node] + trial.extra[node] - returned[node]
                    returned[node] += victim.need
                    lost += workers_in(before, need) - workers_in(before - victim.need, need)
            return lost

        def undo(victim: _Running, nodes: list[int], lost: int) -> None:
            for node in nodes:
                trial.extra[node] -= victim.need
            trial.count -= lost

        for victim in reversed(list(trial.preemptions)):
            nodes = list(victim.nodes)
            for shrunk, node in trial.shrinks:
                if shrunk is victim:
                    nodes.remove(node)
            lost = loss(victim, nodes)
            if trial.count - lost >= workers:
                undo(victim, nodes, lost)
                trial.preemptions.remove(victim)
        kept: list[tuple[_Running, int]] = []
        for victim, node in reversed(trial.shrinks):
            lost = loss(victim, [node])
            if victim not in trial.preemptions and trial.count - lost >= workers:
                undo(victim, [node], lost)
            else:
                kept.append((victim, node))
        trial.shrinks = kept[::-1]

    # --- changes to running jobs -------------------------------------------------------------------------------

    def _resizable(self, job: RunningJob) -> bool:
        return job.last_resized_at is None or self.now - job.last_resized_at >= self.settings.min_resize_interval_s

    def _shrink_worker(self, running: _Running, node: int, for_job: str | None) -> None:
        running.nodes.remove(node)
        running.leaving.append(node)
        self.pools[running.pool].change(node, running.need)
        self.tenant(running.job.tenant).add(running.job.shape, -1, 0)
        if not running.resized:
            running.resized, running.for_job = True, for_job
            self.shrunk.append(running)
        self._update_victim(running)
        self.version += 1

    def _preempt(self, running: _Running, for_job: str | None) -> None:
        for node in running.nodes:
            self.pools[running.pool].change(node, running.need)
        self.tenant(running.job.tenant).add(running.job.shape, -len(running.nodes), -1)
        running.nodes = []
        running.preempted, running.for_job = True, for_job
        self.preempted.append(running)
        self._update_victim(running)
        self.version += 1

    def _update_victim(self, running: _Running) -> None:
        victims = self.victims[running.pool]
        if victims is not None:
            victims.update(running)

    # --- 4. grow back ---------------------------------------------------------------------------------------------

    def grow(self) -> None:
        """Grow jobs below their max into what nobody queued could use, highest priority first."""
        standings = {name: self.standing(tenant.held(), tenant) for name, tenant in self.tenants.items()}
        has_room = [pool.total_free > EPSILON for pool in self.pools]
        candidates: list[tuple[tuple[float, float, float, str], _Running | _Admitted]] = []
        for running in self.running:
            job = running.job
            if not has_room[running.pool] or running.preempted or running.resized:
                continue
            if len(running.nodes) < job.max_workers and self._resizable(job):
                candidates.append(((-job.priority, standings[job.tenant], job.started_at, job.id), running))
        for admitted in self.admitted:
            if len(admitted.nodes) < admitted.upper:
                waited = admitted.job
                candidates.append(((-waited.priority, standings[waited.tenant], self.now, waited.id), admitted))
        candidates.sort(key=lambda candidate: candidate[0])
        for _, candidate in candidates:
            shape, current, tenant = candidate.job.shape, candidate.nodes, self.tenant(candidate.job.tenant)
            upper = candidate.job.max_workers if isinstance(candidate, _Running) else candidate.upper
            pool, need = self.pools[candidate.pool], candidate.need
            if self._holds_back(candidate.pool, None):
                self._apply_hold(candidate.pool)
            room, _ = self._quota_room(tenant, shape, new_job=False)
            more = min(upper - len(current), pool.workers_fitting(need), room)
            if more <= 0:
                continue
            nodes = pool.place(need, more, preferred=current)
            current.extend(nodes)
            tenant.add(shape, more, 0)
            if isinstance(candidate, _Running):
                candidate.added.extend(nodes)
                self.grown.append(candidate)

    # --- the plan -------------------------------------------------------------------------------------------------

    def _ids(self, nodes: list[int]) -> tuple[str, ...]:
        return tuple(self.node_ids[node] for node in nodes)

    def result(self, queue: tuple[QueuePosition, ...]) -> Plan:
        return Plan(
            admissions=tuple(
                Admission(admitted.job.id, len(admitted.nodes), self._ids(admitted.nodes)) for admitted in self.admitted
            ),
            shrinks=tuple(
                Resize(running.job.id, len(running.nodes), self._ids(running.leaving), running.for_job)
                for running in self.shrunk
                if not running.preempted
            ),
            grows=tuple(Resize(running.job.id, len(running.nodes), self._ids(running.added)) for running in self.grown),
            preemptions=tuple(Preemption(running.job.id, running.for_job) for running in self.preempted),
            queue=queue,
        )
