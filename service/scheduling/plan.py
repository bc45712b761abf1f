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
counted per distinct free amount (capacity.py), and a job that waits for the same reason as one before it (same
tenant, shape, size and priority, nothing admitted in between) reuses its verdict.
"""

from __future__ import annotations

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


def _pool_of(shape: WorkerShape) -> int:
    return GPU if shape.gpus > 0 else CPU


def _need_of(shape: WorkerShape) -> float:
    return float(shape.gpus) if shape.gpus > 0 else shape.cpus


def _amount(amount: float, pool: int) -> str:
    return f"{amount:g} {_UNITS[pool]}"


class _Tenant:
    """A tenant's standing during the pass: its quota footprint (as tenants.py counts it) and what it holds."""

    __slots__ = ("cpus", "gpus", "held_cpus", "held_gpus", "jobs", "view")

    def __init__(self, view: TenantView) -> None:
        self.view = view
        self.gpus = 0.0  # quota footprint: every worker's gpus and cpus, as the tenant's quota counts them
        self.cpus = 0.0
        self.jobs = 0
        self.held_gpus = 0.0  # on the cluster: a GPU worker's bundle holds GPUs alone, a CPU worker's CPUs alone
        self.held_cpus = 0.0

    def add(self, shape: WorkerShape, workers: int, jobs: int) -> None:
        self.gpus += shape.gpus * workers
        self.cpus += shape.cpus * workers
        self.jobs += jobs
        held = held_by_workers(shape, workers)
        self.held_gpus += held.gpus
        self.held_cpus += held.cpus

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
    leaving: list[int] = field(default_factory=list)
    added: list[int] = field(default_factory=list)
    preempted: bool = False
    for_job: str | None = None
    resized: bool = False  # shrunk this pass: it grows no sooner than its resize interval allows


@dataclass(slots=True, eq=False)
class _Admitted:
    job: QueuedJob
    nodes: list[int]
    upper: int  # the most it may grow to this pass: workers.max within its tenant's quota at admission
    pool: int
    need: float


@dataclass(slots=True)
class _Trial:
    """The capacity a waiting job would take: single workers shrunk away, and whole jobs preempted."""

    count: int  # workers of the taker's shape that would fit
    extra: dict[int, float] = field(default_factory=dict)  # amount freed per node
    shrinks: list[tuple[_Running, int]] = field(default_factory=list)
    preemptions: list[_Running] = field(default_factory=list)
    freed: dict[str, Held] = field(default_factory=dict)  # tenant → what its victims give up
    protected: tuple[float, str] | None = None  # (when it may give way, job id): the soonest protected victim


class _Pass:
    def __init__(self, state: SchedulingInput) -> None:
        self.now = state.now
        self.settings = state.policy
        self.policy = state.policy.name
        self.las = self.policy is PolicyName.LAS
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
        self.running = [
            _Running(job, [index[node] for node in job.nodes], _pool_of(job.shape), _need_of(job.shape))
            for job in state.running
        ]
        for running in self.running:
            self.tenant(running.job.tenant).add(running.job.shape, running.job.workers, 1)
        active = {job.tenant for job in state.queued} | {job.tenant for job in state.running}
        weights = sum(max(self.tenant(name).view.weight, 0.0) for name in active)
        self.fair_standing = 1.0 / weights if weights > 0 else 0.0  # share over weight of a tenant at its share
        self.order = PlanOrder(
            state.queued,
            {name: tenant.view for name, tenant in self.tenants.items()},
            self.policy,
            self.settings.las_thresholds_gpu_s,
        )
        self.admitted: list[_Admitted] = []
        self.shrunk: list[_Running] = []
        self.grown: list[_Running] = []
        self.preempted: list[_Running] = []
        self.heads: list[str | None] = [None, None]  # the reserved head of the queue per pool
        self.version = 0  # counts the changes to capacity and usage: a verdict reached in one version holds in it
        self.verdicts: dict[tuple[object, ...], tuple[int, str]] = {}
        self.failed_takes: dict[tuple[object, ...], tuple[int, str]] = {}
        self._slack_order: list[_Running] | None = None
        self._whole_order: list[_Running] | None = None

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
        for running in self.running:
            leaving = [node for node in running.nodes if not self.pools[running.pool].placeable(node)]
            if not leaving:
                continue
            staying = len(running.nodes) - len(leaving)
            if self.policy is PolicyName.ELASTIC and staying >= running.job.min_workers:
                for node in leaving:
                    self._shrink_worker(running, node, None)
            else:
                self._preempt(running, None)

    # --- 2. admission ---------------------------------------------------------------------------------------------

    def consider(self, job: QueuedJob) -> str:
        """Admit the job or say why it waits ("" when admitted)."""
        shape = job.shape
        queue = las_queue(job.attained_gpu_seconds, self.settings.las_thresholds_gpu_s) if self.las else 0
        verdict_key = (job.tenant, job.priority, job.min_workers, shape, job.preempted_for, queue)
        known = self.verdicts.get(verdict_key)
        if known is not None and known[0] == self.version:
            return known[1]
        version = self.version
        reason = self._decide(job)
        if reason and self.version == version:
            self.verdicts[verdict_key] = (self.version, reason)
        return reason

    def _decide(self, job: QueuedJob) -> str:
        shape, pool_index, need = job.shape, _pool_of(job.shape), _need_of(job.shape)
        tenant = self.tenant(job.tenant)
        room, over_quota = self._quota_room(tenant, shape, new_job=True)
        if room < job.min_workers:
            return over_quota
        idle = self.idle[pool_index].workers_fitting(need)
        if idle < job.min_workers:
            return f"the cluster's nodes hold only {idle} such workers even idle; it needs {job.min_workers}"
        pool = self.pools[pool_index]
        fitting = pool.workers_fitting(need)
        upper = min(job.max_workers, room)
        if fitting >= job.min_workers:
            size = job.min_workers if self.policy is PolicyName.ELASTIC else min(upper, fitting)
            self._admit(job, size, upper, pool_index, need)
            return ""
        note = ""
        if self.policy in _TAKING:
            taken = self._take_from_lower(job, pool_index, need, fitting, upper)
            if taken is None:
                return ""
            note = taken
        head = self.heads[pool_index]
        if head is None and self.policy in _RESERVING:
            self.heads[pool_index] = job.id
            short = (job.min_workers - fitting) * need
            pool.hold_back(need)
            self.version += 1
            return f"reserved: head of the queue, waits for {_amount(short, pool_index)} more to free{note}"
        wanted = f"waiting for {_amount(job.min_workers * need, pool_index)}"
        if head is not None:
            held = _UNITS[pool_index]
            return f"{wanted}, behind job {head} at the head of the queue, for which the free {held} are held{note}"
        return f"{wanted}; {fitting} such workers fit now{note}"

    def _quota_room(self, tenant: _Tenant, shape: WorkerShape, new_job: bool) -> tuple[int, str]:
        """The most workers of this shape the tenant's quota still allows, and the reason when that is too few."""
        view, name = tenant.view, tenant.view.name
        if new_job and view.quota_jobs is not None and tenant.jobs >= view.quota_jobs:
            return 0, f"over tenant {name}'s quota of {view.quota_jobs} jobs ({tenant.jobs} running)"
        room, reason = _UNBOUNDED, ""
        if view.quota_gpus is not None and shape.gpus > 0:
            fits = workers_in(max(view.quota_gpus - tenant.gpus, 0.0), shape.gpus)
            if fits < room:
                room, reason = fits, f"over tenant {name}'s quota of {view.quota_gpus} GPUs ({tenant.gpus:g} held)"
        if view.quota_cpus is not None and shape.cpus > 0:
            fits = workers_in(max(view.quota_cpus - tenant.cpus, 0.0), shape.cpus)
            if fits < room:
                room, reason = fits, f"over tenant {name}'s quota of {view.quota_cpus:g} CPUs ({tenant.cpus:g} held)"
        return room, reason

    def _admit(self, job: QueuedJob, size: int, upper: int, pool_index: int, need: float) -> None:
        nodes = self.pools[pool_index].place(need, size)
        self.tenant(job.tenant).add(job.shape, size, 1)
        self.admitted.append(_Admitted(job, nodes, upper, pool_index, need))
        self.order.charge(job.tenant, dominant_share(held_by_workers(job.shape, size), self.capacity))
        self.version += 1

    # --- 3. taking capacity from lower-ranked jobs ----------------------------------------------------------------

    def _take_from_lower(self, job: QueuedJob, pool_index: int, need: float, fitting: int, upper: int) -> str | None:
        """Admit the job on capacity that lower-ranked running jobs give up, or say what stops it (None: admitted)."""
        queue = las_queue(job.attained_gpu_seconds, self.settings.las_thresholds_gpu_s) if self.las else 0
        failure_key = (pool_index, need, job.priority, job.tenant, job.preempted_for, queue)
        failed = self.failed_takes.get(failure_key)
        if failed is not None and job.min_workers >= failed[0]:
            return failed[1]  # what could not free room for fewer workers cannot for more
        trial = _Trial(count=fitting)
        taker = self.tenant(job.tenant)
        taker_after = self.standing(taker.held().plus(held_by_workers(job.shape, job.min_workers)), taker)
        if not self.las:
            self._trial_shrinks(job, trial, pool_index, need, taker_after)
        if trial.count < job.min_workers:
            self._trial_preemptions(job, trial, pool_index, need, taker_after, queue)
        if trial.count < job.min_workers:
            note = ""
            if trial.count > fitting:
                note = f"; lower-ranked jobs could make room for only {trial.count} of its {job.min_workers} workers"
            if trial.protected is not None:
                until, protected = trial.protected
                note += f"; job {protected} may give way in {max(until - self.now, 0.0):.0f} s"
            self.failed_takes[failure_key] = (job.min_workers, note)
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

    def _victim_kind(self, job: QueuedJob, victim: _Running, pool_index: int, queue: int) -> str | None:
        """'lower' for a job ranked below the taker, 'borrower' for an equal-priority one of another tenant whose
        share decides, None for a job it may not take from."""
        other = victim.job
        if victim.preempted or victim.pool != pool_index or other.id == job.preempted_for or not victim.nodes:
            return None
        if other.priority < job.priority:
            return "lower"
        if other.priority > job.priority:
            return None
        if self.policy is PolicyName.LAS:
            queue_of = las_queue(other.attained_gpu_seconds, self.settings.las_thresholds_gpu_s)
            return "lower" if queue_of > queue else None
        return "borrower" if other.tenant != job.tenant else None

    def _may_borrow(self, trial: _Trial, victim: _Running, freed: Held, taker_after: float) -> bool:
        """An equal-priority victim gives way only while its tenant holds more than its weighted share, and still holds
        at least the taker's tenant's standing (with the new job) afterwards, so the two cannot take turns."""
        owner = self.tenant(victim.job.tenant)
        if self.standing(owner.held(), owner) <= self.fair_standing + EPSILON:
            return False
        already = trial.freed.get(owner.view.name, Held())
        return taker_after <= self.standing(owner.held(already.plus(freed)), owner) + EPSILON

    def _note_protected(self, trial: _Trial, until: float, victim: _Running) -> None:
        if trial.protected is None or until < trial.protected[0]:
            trial.protected = (until, victim.job.id)

    def _gain(self, trial: _Trial, node: int, amount: float, need: float, pool: Pool) -> int:
        if not pool.placeable(node):
            return 0
        before = pool.free[node] + trial.extra.get(node, 0.0)
        return workers_in(before + amount, need) - workers_in(before, need)

    def _free_in_trial(self, trial: _Trial, victim: _Running, nodes: list[int], need: float, pool: Pool) -> None:
        for node in nodes:
            trial.count += self._gain(trial, node, victim.need, need, pool)
            trial.extra[node] = trial.extra.get(node, 0.0) + victim.need
        owner = victim.job.tenant
        trial.freed[owner] = trial.freed.get(owner, Held()).plus(held_by_workers(victim.job.shape, len(nodes)))

    def _slack_victims(self) -> list[_Running]:
        if self._slack_order is None:
            self._slack_order = sorted(
                self.running,
                key=lambda r: (r.job.priority, -(r.job.workers - r.job.min_workers), -r.job.started_at, r.job.id),
            )
        return self._slack_order

    def _whole_victims(self) -> list[_Running]:
        if self._whole_order is None:
            # las: the most served first; elastic: the newest first, which loses the least work.
            served_first = self.policy is PolicyName.LAS
            self._whole_order = sorted(
                self.running,
                key=lambda r: (
                    r.job.priority,
                    -r.job.attained_gpu_seconds if served_first else 0.0,
                    -r.job.started_at,
                    r.job.id,
                ),
            )
        return self._whole_order

    def _trial_shrinks(self, job: QueuedJob, trial: _Trial, pool_index: int, need: float, taker_after: float) -> None:
        """Take single workers above workers.min, each from the node where it completes the most bundles."""
        pool = self.pools[pool_index]
        for victim in self._slack_victims():
            if victim.job.priority > job.priority:
                break
            kind = self._victim_kind(job, victim, pool_index, 0)
            slack = len(victim.nodes) - victim.job.min_workers
            if kind is None or slack <= 0:
                continue
            if not self._resizable(victim.job):
                self._note_protected(
                    trial, (victim.job.last_resized_at or 0.0) + self.settings.min_resize_interval_s, victim
                )
                continue
            remaining = dict.fromkeys(victim.nodes, 0)
            for node in victim.nodes:
                remaining[node] += 1
            one_worker = held_by_workers(victim.job.shape, 1)
            for _ in range(slack):
                if kind == "borrower" and not self._may_borrow(trial, victim, one_worker, taker_after):
                    break
                node = max(
                    (node for node, count in remaining.items() if count > 0),
                    key=lambda node: (
                        self._gain(trial, node, victim.need, need, pool),
                        pool.free[node] + trial.extra.get(node, 0.0) if pool.placeable(node) else -1.0,
                    ),
                )
                remaining[node] -= 1
                self._free_in_trial(trial, victim, [node], need, pool)
                trial.shrinks.append((victim, node))
                if trial.count >= job.min_workers:
                    return

    def _trial_preemptions(
        self, job: QueuedJob, trial: _Trial, pool_index: int, need: float, taker_after: float, queue: int
    ) -> None:
        """Take whole preemptible jobs that have run their minimum run time."""
        pool = self.pools[pool_index]
        for victim in self._whole_victims():
            if victim.job.priority > job.priority:
                break
            kind = self._victim_kind(job, victim, pool_index, queue)
            if kind is None or not victim.job.preemptible:
                continue
            if self.now - victim.job.started_at < self.settings.min_run_s:
                self._note_protected(trial, victim.job.started_at + self.settings.min_run_s, victim)
                continue
            shrunk_nodes = [node for shrunk, node in trial.shrinks if shrunk is victim]
            nodes = list(victim.nodes)
            for node in shrunk_nodes:
                nodes.remove(node)
            if kind == "borrower" and not self._may_borrow(
                trial, victim, held_by_workers(victim.job.shape, len(nodes)), taker_after
            ):
                continue
            self._free_in_trial(trial, victim, nodes, need, pool)
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
        self.version += 1

    def _preempt(self, running: _Running, for_job: str | None) -> None:
        for node in running.nodes:
            self.pools[running.pool].change(node, running.need)
        self.tenant(running.job.tenant).add(running.job.shape, -len(running.nodes), -1)
        running.nodes = []
        running.preempted, running.for_job = True, for_job
        self.preempted.append(running)
        self.version += 1

    # --- 4. grow back ---------------------------------------------------------------------------------------------

    def grow(self) -> None:
        """Grow jobs below their max into what nobody queued could use, highest priority first."""
        candidates: list[tuple[tuple[float, float, float, str], _Running | _Admitted]] = []
        for running in self.running:
            job = running.job
            if running.preempted or running.resized or len(running.nodes) >= job.max_workers:
                continue
            if self._resizable(job):
                owner = self.tenant(job.tenant)
                candidates.append(
                    ((-job.priority, self.standing(owner.held(), owner), job.started_at, job.id), running)
                )
        for admitted in self.admitted:
            if len(admitted.nodes) < admitted.upper:
                job_queued, owner = admitted.job, self.tenant(admitted.job.tenant)
                rank = (-job_queued.priority, self.standing(owner.held(), owner), self.now, job_queued.id)
                candidates.append((rank, admitted))
        candidates.sort(key=lambda candidate: candidate[0])
        for _, candidate in candidates:
            shape, current, tenant = candidate.job.shape, candidate.nodes, self.tenant(candidate.job.tenant)
            upper = candidate.job.max_workers if isinstance(candidate, _Running) else candidate.upper
            pool, need = self.pools[candidate.pool], candidate.need
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
