"""The event loop and the job model together, on cases small enough to check by hand: with the real plan function
where its decision is plain, and with scripted plans where the arithmetic itself is under test."""

from __future__ import annotations

import pytest

from ringmaster.service.scheduling.model import (
    Admission,
    Plan,
    PolicyName,
    Preemption,
    Resize,
    SchedulingInput,
)
from ringmaster.service.scheduling.plan import plan
from ringmaster.service.simulation.engine import ClusterShape, PlanViolation, Simulation, SimulationRun
from ringmaster.service.simulation.errors import SimulationInputError
from ringmaster.service.simulation.settings import parse_settings
from ringmaster.service.simulation.trace import TraceJob

ONE_NODE = ClusterShape(nodes=1, gpus_per_node=8)
LIVE_INTERVAL = "scheduling_interval_s=0.5"  # the live dispatcher's: passes at arrivals and completions, to the second


def _run(jobs: list[TraceJob], policy: PolicyName, *settings: str, planner=plan, cluster=ONE_NODE) -> SimulationRun:
    return Simulation(tuple(jobs), cluster, parse_settings(list(settings)), policy, planner).run()


def _by_id(run: SimulationRun) -> dict[str, object]:
    return {job.job_id: job for job in run.jobs}


@pytest.mark.parametrize("policy", list(PolicyName))
def test_a_job_alone_on_the_cluster_completes_in_exactly_its_duration(policy: PolicyName) -> None:
    run = _run([TraceJob("alone", 37.0, 1234.5, 6, min_gpus=2)], policy)  # at the default interval
    (job,) = run.jobs
    assert job.first_started_at == 37.0
    assert job.completion_time == 1234.5
    assert job.waited_s == 0.0
    assert (job.preemptions, job.shrinks, job.grows) == (0, 0, 0)


def test_fifo_runs_two_whole_cluster_jobs_one_after_the_other() -> None:
    run = _run([TraceJob("a", 0.0, 1000.0, 8), TraceJob("b", 100.0, 500.0, 8)], PolicyName.FIFO, LIVE_INTERVAL)
    a, b = run.jobs
    assert (a.first_started_at, a.finished_at) == (0.0, 1000.0)
    assert (b.first_started_at, b.finished_at) == (1000.0, 1500.0)
    assert b.waited_s == 900.0
    assert run.allocated_gpu_seconds == 8 * 1500.0


def test_elastic_shrinks_a_lower_priority_job_to_admit_another_and_grows_it_back() -> None:
    """A (8 GPUs, elastic to 4, 1000 s) runs alone; B (priority 1, 4 GPUs, 400 s) arrives at 100. A shrinks to 4 and
    pauses 10 s, B waits for that shrink; when B ends A grows back and pauses 5 s. A: 100 s at full speed, 400 s at
    half (200 s of work) from 110 to 510, then the last 700 s from 515: done at 1215. B: 110 to 510."""
    jobs = [TraceJob("a", 0.0, 1000.0, 8, min_gpus=4), TraceJob("b", 100.0, 400.0, 4, priority=1)]
    run = _run(jobs, PolicyName.ELASTIC, "shrink_s=10", "grow_s=5", LIVE_INTERVAL)
    a, b = run.jobs
    assert (b.first_started_at, b.finished_at) == (100.0, 510.0)
    assert a.finished_at == pytest.approx(1215.0)
    assert (a.shrinks, a.grows, a.preemptions) == (1, 1, 0)


def test_without_running_resizes_a_job_admitted_below_its_request_keeps_that_size_as_live() -> None:
    """X (6 of 8 GPUs, 100 s) runs; F (4 GPUs, elastic to 2, 100 s) arrives at 1 and starts at 2 workers, half speed.
    With resizes F grows to 4 when X ends (a 5 s pause): 49.5 s of work done by 100, the other 50.5 s from 105, done
    at 155.5. Without them, as the live dispatcher (LIVE_RESIZES off), F runs at 2 workers to the end: done at 201."""
    jobs = [TraceJob("x", 0.0, 100.0, 6), TraceJob("f", 1.0, 100.0, 4, min_gpus=2)]
    _, resized = _run(jobs, PolicyName.ELASTIC, "grow_s=5", LIVE_INTERVAL).jobs
    assert resized.finished_at == pytest.approx(155.5) and resized.grows == 1
    _, kept = _run(jobs, PolicyName.ELASTIC, "grow_s=5", "running_resizes=0", LIVE_INTERVAL).jobs
    assert kept.finished_at == pytest.approx(201.0)
    assert (kept.first_started_at, kept.grows, kept.shrinks) == (1.0, 0, 0)


def test_without_running_resizes_the_plan_sees_a_running_job_at_its_size() -> None:
    """As in the live dispatcher's pass input: F (4 GPUs, elastic to 2) running at 4 counts as 4 to 4, not 2 to 4."""
    seen: set[tuple[str, int, int]] = set()

    def admit_each(state: SchedulingInput) -> Plan:
        seen.update((job.id, job.min_workers, job.max_workers) for job in state.running)
        node = state.nodes[0].id
        return Plan(
            admissions=tuple(Admission(job.id, job.max_workers, (node,) * job.max_workers) for job in state.queued)
        )

    jobs = [TraceJob("f", 0.0, 100.0, 4, min_gpus=2), TraceJob("g", 10.0, 10.0, 2)]
    _run(jobs, PolicyName.ELASTIC, "running_resizes=0", LIVE_INTERVAL, planner=admit_each)
    assert ("f", 4, 4) in seen and ("f", 2, 4) not in seen
    seen.clear()
    _run(jobs, PolicyName.ELASTIC, LIVE_INTERVAL, planner=admit_each)
    assert ("f", 2, 4) in seen


def test_running_resizes_is_0_or_1() -> None:
    with pytest.raises(SimulationInputError, match="running_resizes is 0 or 1"):
        parse_settings(["running_resizes=2"])


def test_a_preempted_job_that_is_not_elastic_redoes_the_work_since_its_checkpoint() -> None:
    """A (8 GPUs, not elastic, 5000 s) has run 2500 s when B (priority 1, 8 GPUs, 100 s) arrives: A is preempted and
    loses the 500 s since its checkpoint at 2000 s; B runs 2500–2600; A restarts (20 s) with 3000 s left: done at
    5620."""
    jobs = [TraceJob("a", 0.0, 5000.0, 8), TraceJob("b", 2500.0, 100.0, 8, priority=1)]
    run = _run(jobs, PolicyName.ELASTIC, "checkpoint_interval_s=1000", "preemption_s=0", "restart_s=20", LIVE_INTERVAL)
    a, b = run.jobs
    assert (b.first_started_at, b.finished_at) == (2500.0, 2600.0)
    assert a.preemptions == 1 and a.lost_s == pytest.approx(500.0)
    assert a.finished_at == pytest.approx(5620.0)
    assert a.waited_s == pytest.approx(100.0)


def test_a_preempted_elastic_job_loses_nothing() -> None:
    """As above with A elastic (down to 4): B needs all 8 GPUs, so A is preempted whole, and resumes from memory
    with its 2500 s left: done at 2600 + 20 + 2500."""
    jobs = [TraceJob("a", 0.0, 5000.0, 8, min_gpus=4), TraceJob("b", 2500.0, 100.0, 8, priority=1)]
    run = _run(jobs, PolicyName.ELASTIC, "checkpoint_interval_s=1000", "preemption_s=0", "restart_s=20", LIVE_INTERVAL)
    a, b = run.jobs
    assert b.finished_at == 2600.0
    assert a.lost_s == 0.0
    assert a.finished_at == pytest.approx(5120.0)


def test_a_shrink_slows_a_job_by_its_lost_workers_under_amdahl() -> None:
    """Under Amdahl with s = 0.5, 4 of 8 workers run at (1/(0.5+0.5/4)) / (1/(0.5+0.5/8)) = 0.9 of full speed: the
    900 s left after the shrink at 100 take 1000 s."""

    def decide(state: SchedulingInput) -> Plan:
        if state.queued:
            return Plan(admissions=(Admission("a", 8, ("node-00000",) * 8),))
        (running,) = state.running
        if state.now >= 100 and running.workers == 8:
            return Plan(shrinks=(Resize("a", 4, ("node-00000",) * 4),))
        return Plan()

    run = _run(
        [TraceJob("a", 0.0, 1000.0, 8, min_gpus=4)],
        PolicyName.ELASTIC,
        "scaling=amdahl",
        "serial_fraction=0.5",
        "shrink_s=0",
        "scheduling_interval_s=100",
        planner=decide,  # a decision the real plan would not take: a shrink for nobody
    )
    (a,) = run.jobs
    assert a.finished_at == pytest.approx(1100.0)


def test_a_plan_that_overfills_a_node_is_reported() -> None:
    def decide(state: SchedulingInput) -> Plan:
        return Plan(admissions=tuple(Admission(job.id, 8, ("node-00000",) * 8) for job in state.queued))

    with pytest.raises(PlanViolation, match="placed a worker of job b on node node-00000, which has no free GPU"):
        _run([TraceJob("a", 0.0, 100.0, 8), TraceJob("b", 0.0, 100.0, 8)], PolicyName.FIFO, planner=decide)


def test_a_plan_that_never_starts_anything_is_reported_not_looped_on() -> None:
    with pytest.raises(PlanViolation, match="starts none of 1 queued jobs on an idle cluster"):
        _run([TraceJob("a", 0.0, 100.0, 1)], PolicyName.FIFO, planner=lambda state: Plan())


def test_a_plan_that_preempts_a_queued_job_is_reported() -> None:
    def decide(state: SchedulingInput) -> Plan:
        return Plan(preemptions=(Preemption("a", None),))

    with pytest.raises(PlanViolation, match="asked to preempt job a, which is queued"):
        _run([TraceJob("a", 0.0, 100.0, 1)], PolicyName.FIFO, planner=decide)


def test_a_job_larger_than_the_cluster_is_refused() -> None:
    with pytest.raises(SimulationInputError, match="job big asks for more than the cluster's 8 GPUs"):
        _run([TraceJob("big", 0.0, 100.0, 9)], PolicyName.FIFO)


def test_the_plan_sees_each_tenants_decayed_share_and_weight() -> None:
    seen: list[SchedulingInput] = []

    def decide(state: SchedulingInput) -> Plan:
        seen.append(state)
        return plan(state)

    jobs = [TraceJob("a", 0.0, 7200.0, 8, tenant="x"), TraceJob("b", 3600.0, 10.0, 1, tenant="y")]
    _run(jobs, PolicyName.FAIR, "tenant_weights=y:2", "fair_share_half_life_s=3600", planner=decide)
    at_b = next(state for state in seen if state.now == 3600.0)
    tenants = {view.name: view for view in at_b.tenants}
    # x held the whole cluster for one half-life: its decayed share is 1 − 2^−1.
    assert tenants["x"].decayed_share == pytest.approx(0.5)
    assert tenants["y"].decayed_share == 0.0
    assert (tenants["x"].weight, tenants["y"].weight) == (1.0, 2.0)


def test_passes_are_at_least_one_scheduling_interval_apart() -> None:
    """A starts at 0 (a pass at its arrival); B arrives 30 s later and waits for the pass one interval after A's."""
    run = _run([TraceJob("a", 0.0, 1000.0, 1), TraceJob("b", 30.0, 100.0, 1)], PolicyName.FIFO)
    a, b = run.jobs
    assert a.first_started_at == 0.0
    assert b.first_started_at == 60.0 and b.waited_s == 30.0
