"""Carrying a plan out on a snapshot: what the next pass reads, as the tests and the benchmark chain passes."""

from __future__ import annotations

from ringmaster.service.scheduling.enact import enacted, without_job
from ringmaster.service.scheduling.model import Admission, Plan, Preemption, Resize
from tests.service.scheduling.snapshots import gpu_nodes, queued, running, snapshot


def test_admissions_resizes_and_preemptions_move_jobs_and_capacity() -> None:
    state = snapshot(
        gpu_nodes(4, gpus=2),
        [
            running("shrinks", ["n0", "n0"], min_workers=1, max_workers=2),
            running("grows", ["n1"], min_workers=1, max_workers=3),
            running("goes", ["n2", "n2"], submitted_at=5.0),
        ],
        [queued("starts", 2, submitted_at=7.0)],
        now=100.0,
    )
    decided = Plan(
        admissions=(Admission("starts", 2, ("n2", "n0")),),
        shrinks=(Resize("shrinks", 1, ("n0",), for_job="starts"),),
        grows=(Resize("grows", 2, ("n1",)),),
        preemptions=(Preemption("goes", for_job="starts"),),
    )
    after = enacted(state, decided)
    jobs = {job.id: job for job in after.running}
    assert jobs["shrinks"].nodes == ("n0",) and jobs["shrinks"].last_resized_at == 100.0
    assert jobs["grows"].nodes == ("n1", "n1") and jobs["grows"].last_resized_at == 100.0
    assert jobs["starts"].nodes == ("n2", "n0") and jobs["starts"].started_at == 100.0
    assert jobs["starts"].submitted_at == 7.0
    [requeued] = after.queued
    assert (requeued.id, requeued.preempted_for, requeued.submitted_at) == ("goes", "starts", 5.0)
    assert {node.id: node.free_gpus for node in after.nodes} == {"n0": 0, "n1": 0, "n2": 1, "n3": 2}


def test_a_job_that_ends_frees_its_workers() -> None:
    state = snapshot(gpu_nodes(2, gpus=2), [running("done", ["n0", "n0", "n1"])])
    after = without_job(state, "done")
    assert after.running == () and [node.free_gpus for node in after.nodes] == [2, 2]
