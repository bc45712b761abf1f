"""What every plan must respect, whatever the snapshot: checked on many random busy clusters and on one at scale."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from ringmaster.service.scheduling.enact import enacted
from ringmaster.service.scheduling.model import Plan, PolicyName, SchedulingInput
from ringmaster.service.scheduling.plan import plan
from tests.service.scheduling.snapshots import random_snapshot

NOT_RESIZING = (PolicyName.FIFO, PolicyName.BACKFILL, PolicyName.FAIR, PolicyName.LAS)
NOT_TAKING = (PolicyName.FIFO, PolicyName.BACKFILL, PolicyName.FAIR)


def check(state: SchedulingInput, decided: Plan) -> None:
    queued = {job.id: job for job in state.queued}
    running = {job.id: job for job in state.running}
    draining = {node.id for node in state.nodes if node.drain_deadline is not None}
    settings = state.policy

    assert sorted(position.job_id for position in decided.queue) == sorted(queued)
    assert [position.position for position in decided.queue] == list(range(1, len(queued) + 1))
    admitted = {admission.job_id for admission in decided.admissions}
    assert {position.job_id for position in decided.queue if position.reason == ""} == admitted

    for admission in decided.admissions:
        job = queued[admission.job_id]
        assert job.min_workers <= admission.workers <= job.max_workers
        assert len(admission.nodes) == admission.workers and not draining & set(admission.nodes)

    touched = Counter(
        [shrink.job_id for shrink in decided.shrinks]
        + [grow.job_id for grow in decided.grows]
        + [preemption.job_id for preemption in decided.preemptions]
    )
    assert all(count == 1 for count in touched.values()), touched
    for shrink in decided.shrinks:
        job = running[shrink.job_id]
        assert job.min_workers <= shrink.workers == job.workers - len(shrink.nodes)
        assert not Counter(shrink.nodes) - Counter(job.nodes)
        if shrink.for_job is not None:
            assert job.last_resized_at is None or state.now - job.last_resized_at >= settings.min_resize_interval_s
            assert queued[shrink.for_job].priority >= job.priority
    for grow in decided.grows:
        job = running[grow.job_id]
        assert grow.workers == job.workers + len(grow.nodes) <= job.max_workers
        assert not draining & set(grow.nodes)
        assert job.last_resized_at is None or state.now - job.last_resized_at >= settings.min_resize_interval_s
    for preemption in decided.preemptions:
        job = running[preemption.job_id]
        if preemption.for_job is None:
            assert draining & set(job.nodes)
            continue
        taker = queued[preemption.for_job]
        assert preemption.for_job in admitted and taker.preempted_for != job.id
        assert job.preemptible and state.now - job.started_at >= settings.min_run_s
        assert taker.priority >= job.priority
    if settings.name in NOT_RESIZING:
        assert decided.shrinks == decided.grows == ()
    if settings.name in NOT_TAKING:
        assert all(preemption.for_job is None for preemption in decided.preemptions)

    after = enacted(state, decided)
    for node in after.nodes:
        assert node.free_gpus >= 0 and node.free_cpus >= -1e-9, node
    for tenant in state.tenants:
        jobs = [job for job in after.running if job.tenant == tenant.name]
        if tenant.quota_gpus is not None:
            assert sum(job.shape.gpus * job.workers for job in jobs) <= tenant.quota_gpus
        if tenant.quota_cpus is not None:
            assert sum(job.shape.cpus * job.workers for job in jobs) <= tenant.quota_cpus + 1e-9
        if tenant.quota_jobs is not None:
            assert len(jobs) <= tenant.quota_jobs


@pytest.mark.parametrize("policy", list(PolicyName))
@pytest.mark.parametrize("seed", range(25))
def test_random_busy_cluster_plans_respect_capacity_ranges_quotas_and_protections(
    policy: PolicyName, seed: int
) -> None:
    state = random_snapshot(random.Random(seed), policy)
    decided = plan(state)
    check(state, decided)
    assert plan(state) == decided


@pytest.mark.parametrize("policy", [PolicyName.ELASTIC, PolicyName.LAS])
@pytest.mark.parametrize("seed", range(5))
def test_chained_passes_settle_without_taking_turns(policy: PolicyName, seed: int) -> None:
    """Passes over the enacted outcome of the one before, each past every protection of the last: each valid, and
    with no job arriving or ending, the preemptions and resizes die out instead of going back and forth."""
    state = random_snapshot(random.Random(seed), policy)
    changes = []
    for _ in range(8):
        decided = plan(state)
        check(state, decided)
        changes.append(len(decided.preemptions) + len(decided.shrinks))
        state = replace(enacted(state, decided), now=state.now + state.policy.min_run_s + 1)
    assert changes[0] > 0 and changes[-2:] == [0, 0], changes


@pytest.mark.parametrize("policy", [PolicyName.ELASTIC, PolicyName.LAS])
def test_ten_thousand_queued_jobs_on_a_thousand_nodes(policy: PolicyName) -> None:
    """Correctness at the benchmark's scale (its time is bench/scheduling.py's to measure)."""
    state = random_snapshot(random.Random(3), policy, nodes=1_000, queued_jobs=10_000)
    decided = plan(state)
    check(state, decided)
    assert decided.admissions
