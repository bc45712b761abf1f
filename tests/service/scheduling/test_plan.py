"""The scheduling plan, policy by policy: what it admits, shrinks, grows and preempts, and why the others wait."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from ringmaster.service.scheduling.enact import enacted, without_job
from ringmaster.service.scheduling.model import NodeView, Plan, PolicyName, SchedulingInput, TenantView
from ringmaster.service.scheduling.plan import plan
from tests.service.scheduling.snapshots import ONE_CPU, gpu_nodes, queued, running, snapshot

ELASTIC, FIFO, BACKFILL, FAIR, LAS = (
    PolicyName.ELASTIC,
    PolicyName.FIFO,
    PolicyName.BACKFILL,
    PolicyName.FAIR,
    PolicyName.LAS,
)


def reason_of(decided: Plan, job_id: str) -> str:
    return next(position.reason for position in decided.queue if position.job_id == job_id)


def admitted(decided: Plan) -> dict[str, tuple[str, ...]]:
    return {admission.job_id: admission.nodes for admission in decided.admissions}


# --- priority, and the old trial-admission loop's inversion ----------------------------------------------------------


@pytest.mark.parametrize("policy", list(PolicyName))
def test_priority_job_gets_freed_capacity_before_twenty_older_low_priority_jobs(policy: PolicyName) -> None:
    busy = running("busy", ["n0", "n1"])
    low = [queued(f"low{index:02d}", 2, submitted_at=float(index)) for index in range(20)]
    high = queued("high", 2, priority=9, submitted_at=100.0)
    state = snapshot(gpu_nodes(2), [busy], [*low, high], policy=policy)

    decided = plan(without_job(state, "busy"))

    assert admitted(decided) == {"high": ("n0", "n1")}
    assert decided.queue[0].job_id == "high"
    assert [position.position for position in decided.queue] == list(range(1, 22))


# --- backfill: a reservation for the head of the queue -------------------------------------------------------------


def passes_until_started(
    policy: PolicyName, big_job: str = "big", passes: int = 12, stream_preemptible: bool = True
) -> int | None:
    """Four 1-GPU nodes; a 4-worker job waits while a 1-worker job arrives every pass and each job runs 4 passes."""
    state = snapshot(
        gpu_nodes(4),
        [running(f"r{index}", [f"n{index}"]) for index in range(4)],
        [queued(big_job, 4, submitted_at=0.0)],
        policy=policy,
    )
    ends = {f"r{index}": index + 1 for index in range(4)}
    for number in range(1, passes + 1):
        for job in [job for job in state.running if ends[job.id] <= number]:
            state = without_job(state, job.id)
        small = queued(f"small{number}", 1, submitted_at=float(number), preemptible=stream_preemptible)
        state = replace(state, queued=(*state.queued, small))
        decided = plan(state)
        for admission in decided.admissions:
            ends[admission.job_id] = number + 4
            if admission.job_id == big_job:
                return number
        state = enacted(state, decided)
    return None


def test_fifo_starves_a_four_worker_job_behind_a_stream_of_one_worker_jobs() -> None:
    assert passes_until_started(FIFO) is None


@pytest.mark.parametrize("policy", [BACKFILL, FAIR, ELASTIC])
def test_reservation_starts_a_four_worker_job_despite_a_stream_of_one_worker_jobs(policy: PolicyName) -> None:
    # The pass at which the last of the four running jobs ends. Under elastic the stream's jobs are not preemptible
    # here: nobody could take them back, so the claim holds the GPUs from them.
    assert passes_until_started(policy, stream_preemptible=policy is not ELASTIC) == 4


def test_elastic_lets_a_preemptible_stream_use_the_gpus_a_claim_waits_for_until_its_wait_is_bounded() -> None:
    # The big job cannot take from the four jobs it waits on (as old as it): how long they run is unknown, so the
    # stream's preemptible jobs use the GPUs that free. Once what it lacks is jobs it may take when their minimum run
    # ends (the stream's, younger), the GPUs are held for it; here the clock stands still, so the stream's jobs end
    # (3 passes later) before their minimum run does.
    assert passes_until_started(ELASTIC) == 7


def test_reserved_head_holds_the_free_capacity_and_smaller_jobs_wait_behind_it() -> None:
    state = snapshot(
        gpu_nodes(4),
        [running("r0", ["n0"]), running("r1", ["n1"])],
        [queued("big", 4, submitted_at=0.0), queued("small", 1, submitted_at=1.0)],
        policy=BACKFILL,
    )
    decided = plan(state)
    assert decided.admissions == ()
    assert reason_of(decided, "big") == "reserved: head of the queue, waits for 2 GPUs more to free"
    assert "behind job big" in reason_of(decided, "small")


def test_backfill_lets_a_job_of_another_resource_pass_the_reserved_head() -> None:
    nodes = [NodeView(f"n{index}", 1, 4.0, 1, 4.0) for index in range(4)]
    cpu_job = queued("cpu", 2, submitted_at=1.0, shape=ONE_CPU)
    busy = [running("r0", ["n0"]), running("r1", ["n1"])]
    state = snapshot(nodes, busy, [queued("big", 4, submitted_at=0.0), cpu_job], policy=BACKFILL)
    decided = plan(state)
    assert set(admitted(decided)) == {"cpu"}
    assert reason_of(decided, "big").startswith("reserved")


# --- elastic: shrink to admit, preempt whole only when it suffices -------------------------------------------------


def test_elastic_shrinks_two_lower_priority_elastic_jobs_to_admit_a_high_one() -> None:
    state = snapshot(
        gpu_nodes(4),
        [
            running("a", ["n0", "n1"], min_workers=1, max_workers=2, started_at=9_990.0),
            running("b", ["n2", "n3"], min_workers=1, max_workers=2, started_at=9_990.0),
        ],
        [queued("high", 2, priority=9)],
    )
    decided = plan(state)
    assert decided.preemptions == ()
    assert {(shrink.job_id, shrink.workers, shrink.for_job) for shrink in decided.shrinks} == {
        ("a", 1, "high"),
        ("b", 1, "high"),
    }
    assert sorted(admitted(decided)["high"]) == sorted(shrink.nodes[0] for shrink in decided.shrinks)
    assert reason_of(decided, "high") == ""


def test_elastic_never_shrinks_below_min_and_preempts_the_rest_whole() -> None:
    state = snapshot(
        gpu_nodes(4),
        [
            running("older", ["n0", "n1"], min_workers=1, max_workers=2, started_at=1_000.0),
            running("newer", ["n2", "n3"], min_workers=1, max_workers=2, started_at=2_000.0),
        ],
        [queued("high", 3, priority=9)],
    )
    decided = plan(state)
    assert admitted(decided).keys() == {"high"}
    assert [(p.job_id, p.for_job) for p in decided.preemptions] == [("newer", "high")]  # the newest loses least
    assert [(shrink.job_id, shrink.workers) for shrink in decided.shrinks] == [("older", 1)]


def test_no_shrink_or_preemption_for_a_job_that_still_would_not_start() -> None:
    state = snapshot(
        gpu_nodes(4),
        [
            running("a", ["n0", "n1"], min_workers=1, max_workers=2, preemptible=False),
            running("b", ["n2", "n3"], min_workers=1, max_workers=2, preemptible=False),
        ],
        [queued("high", 3, priority=9)],
    )
    decided = plan(state)
    assert decided.admissions == decided.shrinks == decided.preemptions == ()
    assert "could make room for at most 2 of its 3 workers" in reason_of(decided, "high")


def test_elastic_preempts_a_non_elastic_job_whole_only_when_the_whole_plan_suffices() -> None:
    jobs = [running("low", ["n0", "n1"], priority=0), running("mid", ["n2", "n3"], priority=5)]
    above_both = plan(snapshot(gpu_nodes(4), jobs, [queued("high", 4, priority=9)]))
    assert {p.job_id for p in above_both.preemptions} == {"low", "mid"}
    assert admitted(above_both).keys() == {"high"}

    between = plan(snapshot(gpu_nodes(4), jobs, [queued("high", 4, priority=3)]))
    assert between.preemptions == () and between.admissions == ()


def test_no_preemption_before_the_minimum_run_time() -> None:
    young = running("young", ["n0", "n1"], started_at=9_900.0)
    decided = plan(snapshot(gpu_nodes(2), [young], [queued("high", 2, priority=9)], now=10_000.0, min_run_s=300.0))
    assert decided.preemptions == ()
    assert reason_of(decided, "high").endswith("job young may give way in 200 s")

    later = plan(snapshot(gpu_nodes(2), [young], [queued("high", 2, priority=9)], now=10_201.0, min_run_s=300.0))
    assert [p.job_id for p in later.preemptions] == ["young"]


def test_no_shrink_within_the_minimum_resize_interval() -> None:
    resized = running("e", ["n0", "n1"], min_workers=1, max_workers=2, last_resized_at=9_990.0, preemptible=False)
    state = snapshot(gpu_nodes(2), [resized], [queued("high", 1, priority=9)], now=10_000.0, min_resize_interval_s=60)
    assert plan(state).shrinks == ()
    assert [shrink.job_id for shrink in plan(replace(state, now=10_051.0)).shrinks] == ["e"]


def test_a_preempted_job_never_preempts_the_job_it_made_way_for() -> None:
    """Under las a less-served job preempts a more-served one of equal priority; the one it preempted, back in the
    queue with less service than the newcomer will soon have, must not preempt it back."""
    holder = running("holder", ["n0", "n1"], attained_gpu_seconds=1e6, started_at=0.0)
    state = snapshot(gpu_nodes(2), [holder], [queued("newcomer", 2)], policy=LAS)
    assert [p.job_id for p in plan(state).preemptions] == ["holder"]

    back = snapshot(gpu_nodes(2), [holder], [queued("newcomer", 2, preempted_for="holder")], policy=LAS)
    decided = plan(back)
    assert decided.preemptions == () and decided.admissions == ()


def test_las_takes_only_from_more_served_jobs() -> None:
    served = running("served", ["n0", "n1"], attained_gpu_seconds=10.0, started_at=0.0)  # the first queue too
    decided = plan(snapshot(gpu_nodes(2), [served], [queued("newcomer", 2)], policy=LAS))
    assert decided.preemptions == ()


def test_las_orders_the_queue_by_attained_service() -> None:
    jobs = [
        queued("served", 1, attained_gpu_seconds=5e4, submitted_at=0.0),
        queued("fresh", 1, attained_gpu_seconds=0.0, submitted_at=5.0),
    ]
    decided = plan(snapshot(gpu_nodes(1), [], jobs, policy=LAS))
    assert admitted(decided).keys() == {"fresh"}
    assert [position.job_id for position in decided.queue] == ["fresh", "served"]


# --- grow back ----------------------------------------------------------------------------------------------------


def test_elastic_jobs_grow_back_into_capacity_nobody_queued_can_use() -> None:
    shrunk = running("shrunk", ["n0"], min_workers=1, max_workers=3, priority=1, last_resized_at=0.0)
    other = running("other", ["n1"], min_workers=1, max_workers=2, priority=0)
    decided = plan(snapshot(gpu_nodes(4), [shrunk, other], []))
    grows = {grow.job_id: grow for grow in decided.grows}
    assert grows["shrunk"].workers == 3 and len(grows["shrunk"].nodes) == 2  # the higher priority grows first
    assert "other" not in grows  # nothing left
    assert plan(snapshot(gpu_nodes(4), [shrunk, other], [], policy=FAIR)).grows == ()


def test_no_growth_into_the_reserved_heads_capacity_or_soon_after_a_resize() -> None:
    # big may take both running jobs, the blocker once its minimum run ends in 200 s: its wait is bounded.
    elastic = running("elastic", ["n0"], min_workers=1, max_workers=3, submitted_at=1.0)
    blocker = running("blocker", ["n1"], started_at=9_900.0, submitted_at=5_000.0)
    decided = plan(snapshot(gpu_nodes(4), [elastic, blocker], [queued("big", 4)]))
    assert decided.grows == () and decided.admissions == () and decided.preemptions == ()
    assert reason_of(decided, "big").startswith("reserved: head of the queue")

    # A blocker nobody can take: how long big waits is unknown, and the elastic job grows rather than leave it idle.
    unbounded = [elastic, replace(blocker, preemptible=False)]
    decided = plan(snapshot(gpu_nodes(4), unbounded, [queued("big", 4)]))
    assert [(grow.job_id, grow.workers) for grow in decided.grows] == [("elastic", 3)]

    recently = replace(elastic, last_resized_at=9_990.0)
    assert plan(snapshot(gpu_nodes(4), [recently], [], now=10_000.0)).grows == ()


def test_a_new_elastic_job_starts_at_its_minimum_and_grows_into_what_is_left() -> None:
    decided = plan(snapshot(gpu_nodes(4), [], [queued("a", 1, max_workers=3), queued("b", 2, submitted_at=1.0)]))
    assert {admission.job_id: admission.workers for admission in decided.admissions} == {"a": 2, "b": 2}


# --- drain --------------------------------------------------------------------------------------------------------


def test_drained_node_takes_nothing_new_and_its_jobs_shrink_off_it_or_move() -> None:
    nodes = gpu_nodes(4, gpus=2)
    nodes[3] = replace(nodes[3], drain_deadline=10_300.0)
    elastic = running("elastic", ["n2", "n3"], min_workers=1, max_workers=2)
    elsewhere = running("elsewhere", ["n1"])
    at_min = running("at-min", ["n3"], min_workers=1, max_workers=1)
    jobs = [elastic, elsewhere, at_min]
    decided = plan(snapshot(nodes, jobs, [queued("new", 2)]))
    assert [(shrink.job_id, shrink.nodes, shrink.for_job) for shrink in decided.shrinks] == [("elastic", ("n3",), None)]
    assert [(p.job_id, p.for_job) for p in decided.preemptions] == [("at-min", None)]
    assert "n3" not in admitted(decided)["new"]

    fifo = plan(snapshot(nodes, jobs, [], policy=FIFO))  # the policies that do not resize move a job whole
    assert {p.job_id for p in fifo.preemptions} == {"elastic", "at-min"} and fifo.shrinks == ()


# --- quotas -------------------------------------------------------------------------------------------------------


def test_quotas_are_hard_ceilings_over_running_and_newly_admitted_jobs() -> None:
    tenants = [TenantView("a", quota_gpus=4), TenantView("b", quota_jobs=1)]
    state = snapshot(
        gpu_nodes(8),
        [running("a-running", ["n0", "n1", "n2"], tenant="a"), running("b-running", ["n3"], tenant="b")],
        [
            queued("a-two", 2, tenant="a", submitted_at=0.0),
            queued("a-elastic", 1, max_workers=4, tenant="a", submitted_at=1.0),
            queued("b-one", 1, tenant="b", submitted_at=2.0),
        ],
        policy=FIFO,
        tenants=tenants,
    )
    decided = plan(state)
    assert {admission.job_id: admission.workers for admission in decided.admissions} == {"a-elastic": 1}
    assert reason_of(decided, "a-two") == (
        "over quota: tenant 'a' holds 3 of its 4 GPU(s); this job needs 2 more at workers.min 2"
    )
    assert reason_of(decided, "b-one") == "over quota: tenant 'b' already runs 1 of its 1 concurrent job(s)"


def test_a_job_larger_than_the_idle_cluster_says_so_and_blocks_nobody() -> None:
    decided = plan(
        snapshot(gpu_nodes(2), [], [queued("huge", 3), queued("small", 1, submitted_at=1.0)], policy=BACKFILL)
    )
    assert reason_of(decided, "huge") == (
        "the cluster's nodes hold only 2 workers of 1 GPUs each even when idle; it needs 3: it waits for nodes to join"
    )
    assert admitted(decided).keys() == {"small"}


# --- fair share ---------------------------------------------------------------------------------------------------


def test_fair_orders_equal_priorities_by_decayed_share_over_weight() -> None:
    tenants = [
        TenantView("x", weight=1.0, decayed_share=0.5),
        TenantView("y", weight=1.0, decayed_share=0.3),
        TenantView("z", weight=2.0, decayed_share=0.5),
    ]
    jobs = [
        queued("x-old", 1, tenant="x", submitted_at=0.0),
        queued("y-mid", 1, tenant="y", submitted_at=1.0),
        queued("z-new", 1, tenant="z", submitted_at=2.0),
        queued("x-urgent", 1, tenant="x", priority=5, submitted_at=3.0),
    ]
    fair = plan(snapshot(gpu_nodes(1), [], jobs, policy=FAIR, tenants=tenants))
    assert [position.job_id for position in fair.queue] == ["x-urgent", "z-new", "y-mid", "x-old"]
    fifo = plan(snapshot(gpu_nodes(1), [], jobs, policy=FIFO, tenants=tenants))
    assert [position.job_id for position in fifo.queue] == ["x-urgent", "x-old", "y-mid", "z-new"]


def test_fair_alternates_tenants_within_one_pass_as_it_admits() -> None:
    tenants = [TenantView("x"), TenantView("y")]
    jobs = [queued(f"x{index}", 1, tenant="x", submitted_at=index) for index in range(4)]
    jobs += [queued(f"y{index}", 1, tenant="y", submitted_at=10 + index) for index in range(4)]
    decided = plan(snapshot(gpu_nodes(4), [], jobs, policy=FAIR, tenants=tenants))
    assert sorted(admitted(decided)) == ["x0", "x1", "y0", "y1"]


def test_a_borrowing_tenant_shrinks_to_give_an_equal_priority_tenant_its_share() -> None:
    tenants = [TenantView("a"), TenantView("b")]
    borrower = running("borrower", ["n0", "n1", "n2", "n3"], tenant="a", min_workers=1, max_workers=4)
    state = snapshot(gpu_nodes(4), [borrower], [queued("b-job", 2, tenant="b")], tenants=tenants)
    decided = plan(state)
    assert [(shrink.job_id, shrink.workers) for shrink in decided.shrinks] == [("borrower", 2)]
    assert admitted(decided).keys() == {"b-job"}

    beyond_share = plan(replace(state, queued=(queued("b-job", 3, tenant="b"),)))
    assert beyond_share.shrinks == () and beyond_share.admissions == ()  # 3 of 4 would put b above a
    assert plan(replace(state, policy=replace(state.policy, name=FAIR))).shrinks == ()


def test_the_same_tenant_never_takes_from_itself_at_equal_priority() -> None:
    own = running("own", ["n0", "n1"], tenant="a", min_workers=1, max_workers=2)
    decided = plan(snapshot(gpu_nodes(2), [own], [queued("mine", 1, tenant="a")], tenants=[TenantView("a")]))
    assert decided.shrinks == () and decided.admissions == ()


# --- determinism --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(PolicyName))
def test_same_snapshot_same_plan_whatever_the_order_of_jobs(policy: PolicyName) -> None:
    rng = random.Random(7)
    runs = [running(f"r{index}", [f"n{index}"], priority=index % 3, min_workers=1) for index in range(6)]
    waits = [
        queued(f"q{index}", rng.randint(1, 3), priority=rng.randint(0, 4), submitted_at=float(index % 4))
        for index in range(30)
    ]
    state = snapshot(gpu_nodes(8), runs, waits, policy=policy)
    shuffled = replace(state, queued=tuple(rng.sample(waits, len(waits))), running=tuple(rng.sample(runs, len(runs))))
    assert plan(state) == plan(state) == plan(shuffled)


def test_every_queued_job_gets_one_position_in_plan_order() -> None:
    state: SchedulingInput = snapshot(
        gpu_nodes(3), [], [queued(f"q{index}", 2, submitted_at=index) for index in range(5)]
    )
    decided = plan(state)
    assert [position.job_id for position in decided.queue] == [f"q{index}" for index in range(5)]
    assert [bool(position.reason) for position in decided.queue] == [False, True, True, True, True]


# --- elastic: least attained service within a tenant, no idle hold, claims after reserve_after_s ------------------


def test_elastic_takes_a_tenants_least_served_job_first_until_a_served_one_has_waited_reserve_after_s() -> None:
    jobs = [
        queued("served", 1, attained_gpu_seconds=5e4, submitted_at=0.0),
        queued("fresh", 1, attained_gpu_seconds=0.0, submitted_at=5.0),
    ]
    soon = plan(snapshot(gpu_nodes(1), [], jobs, now=1_000.0))  # reserve_after_s 1800: neither has waited that long
    assert [position.job_id for position in soon.queue] == ["fresh", "served"]
    late = plan(snapshot(gpu_nodes(1), [], jobs, now=1_805.0))  # served waited 1805 s: it counts as unserved
    assert [position.job_id for position in late.queue] == ["served", "fresh"]
    fair = plan(snapshot(gpu_nodes(1), [], jobs, now=1_000.0, policy=FAIR))
    assert [position.job_id for position in fair.queue] == ["served", "fresh"]  # fair stays oldest first


def test_elastic_head_that_has_not_waited_long_holds_nothing_and_the_jobs_behind_use_the_free_gpus() -> None:
    state = snapshot(
        gpu_nodes(4),
        [running("r0", ["n0"]), running("r1", ["n1"])],
        [queued("big", 4, submitted_at=9_500.0), queued("small", 1, submitted_at=9_600.0)],
    )
    decided = plan(state)
    assert admitted(decided).keys() == {"small"}
    assert reason_of(decided, "big") == "reserved: head of the queue, waits for 2 GPUs more to free"
    assert decided.preemptions == ()


def test_a_job_that_waited_reserve_after_s_preempts_a_younger_job_of_its_priority_not_an_older_one() -> None:
    younger = running("younger", ["n0", "n1"], tenant="b", started_at=9_000.0, submitted_at=5_000.0)
    old = queued("old", 2, tenant="a", submitted_at=0.0)
    tenants = [TenantView("a"), TenantView("b")]
    decided = plan(snapshot(gpu_nodes(2), [younger], [old], tenants=tenants))
    assert [(p.job_id, p.for_job) for p in decided.preemptions] == [("younger", "old")]
    assert admitted(decided).keys() == {"old"}

    not_long = plan(snapshot(gpu_nodes(2), [younger], [replace(old, submitted_at=8_500.0)], tenants=tenants))
    assert not_long.preemptions == () and not_long.admissions == ()  # waited 1500 s < reserve_after_s

    older = replace(younger, submitted_at=0.0)
    newer_taker = plan(snapshot(gpu_nodes(2), [older], [replace(old, submitted_at=100.0)], tenants=tenants))
    assert newer_taker.preemptions == () and newer_taker.admissions == ()


def test_a_claim_shrinks_elastic_slack_before_it_preempts_a_whole_job() -> None:
    elastic = running("elastic", ["n0", "n1"], min_workers=1, max_workers=2, started_at=9_000.0, submitted_at=6_000.0)
    whole = running("whole", ["n2", "n3"], started_at=9_000.0, submitted_at=7_000.0)
    decided = plan(snapshot(gpu_nodes(4), [elastic, whole], [queued("old", 1, submitted_at=0.0)]))
    assert decided.preemptions == ()
    assert [(shrink.job_id, shrink.workers, shrink.for_job) for shrink in decided.shrinks] == [("elastic", 1, "old")]
    assert admitted(decided).keys() == {"old"}


def test_a_claim_that_cannot_start_holds_the_free_gpus_only_after_hold_after_s() -> None:
    blockers = [running("r0", ["n0"], preemptible=False), running("r1", ["n1"], preemptible=False)]
    big, small = queued("big", 4, submitted_at=0.0), queued("small", 1, submitted_at=1.0, preemptible=False)
    before_hold = plan(snapshot(gpu_nodes(4), blockers, [big, small], now=5_000.0))  # 1800 <= waited < 7200
    assert admitted(before_hold).keys() == {"small"}
    after_hold = plan(snapshot(gpu_nodes(4), blockers, [big, small], now=7_300.0))
    assert after_hold.admissions == ()
    assert "behind job big at the head of the queue, for which the free GPUs are held" in reason_of(after_hold, "small")
    # big waits on jobs nobody can take, for a time nobody knows: a preemptible job, which it can take back once it
    # could start, uses the GPUs meanwhile.
    preemptible = plan(snapshot(gpu_nodes(4), blockers, [big, replace(small, preemptible=True)], now=7_300.0))
    assert admitted(preemptible).keys() == {"small"}


def test_fair_share_preempts_an_equal_priority_tenant_only_above_twice_its_weighted_share() -> None:
    holders = [running(f"a{index}", [f"n{index}"], tenant="a") for index in range(4)]
    two = [TenantView("a"), TenantView("b")]
    decided = plan(snapshot(gpu_nodes(4), holders, [queued("b-job", 1, tenant="b")], tenants=two))
    assert decided.preemptions == ()  # a holds 1.0, not above 2 × its share of 0.5

    three = [*two, TenantView("c")]
    jobs = [queued("b-job", 1, tenant="b"), queued("c-job", 1, tenant="c", submitted_at=1.0)]
    decided = plan(snapshot(gpu_nodes(4), holders, jobs, tenants=three))
    assert decided.preemptions and {p.for_job for p in decided.preemptions} <= {"b-job", "c-job"}  # above 2 × 1/3
