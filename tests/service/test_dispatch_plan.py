"""The dispatcher's memory between passes keeps the plan's input objects, so a pass over thousands of running jobs
and nodes builds only what changed, and plans on exactly what it would have built afresh."""

from __future__ import annotations

from ringmaster.service.dispatch_plan import ActiveAttempt, JobsRead, KnownJobs, pass_input
from ringmaster.service.ray_cluster import ClusterView, NodeResources
from ringmaster.service.scheduling.fair_share import FairShareLedger
from ringmaster.service.scheduling.model import PolicySettings, SchedulingInput, WorkerShape


def _attempt(job_id: str) -> ActiveAttempt:
    return ActiveAttempt(
        id=job_id,
        tenant="team-0",
        priority=0,
        shape=WorkerShape(gpus=1, cpus=1.0),
        min_workers=1,
        max_workers=2,
        preemptible=True,
        submitted_at=0.0,
        placement_group=f"pg-{job_id}",
        started_at=0.0,
    )


def _view(free_gpus: float, b_bundles: list[str | None]) -> ClusterView:
    nodes = [
        NodeResources(id="n1", CPU=8.0, GPU=4.0, free_CPU=8.0, free_GPU=free_gpus),
        NodeResources(id="n2", CPU=8.0, GPU=4.0, free_CPU=8.0, free_GPU=3.0),
    ]
    return ClusterView(nodes=nodes, groups={"pg-a": ["n1"], "pg-b": b_bundles})


def _input(jobs: JobsRead, view: ClusterView, known: KnownJobs | None) -> SchedulingInput:
    ledger = FairShareLedger(3600.0, start=0.0)
    return pass_input(jobs, view, PolicySettings(), ledger, 1.0, resizable=False, known=known)


def test_a_pass_takes_last_passs_input_objects_and_rebuilds_only_those_whose_source_changed() -> None:
    jobs = JobsRead(queued=(), active=((_attempt("a"), False), (_attempt("b"), False)), tenants=(), new_in_queue=False)
    known = KnownJobs()
    first = _input(jobs, _view(2.0, ["n1", None]), known)
    again = _input(jobs, _view(2.0, ["n1", None]), known)
    assert [job.id for job in first.running] == ["a", "b"] and first.running[1].nodes == ("n1",)
    assert all(kept is made for kept, made in zip(again.running, first.running, strict=True))
    assert all(kept is made for kept, made in zip(again.nodes, first.nodes, strict=True))

    moved = _input(jobs, _view(1.0, ["n1", "n2"]), known)  # b's second bundle placed, n1 fuller
    assert moved.running[0] is first.running[0] and moved.nodes[1] is first.nodes[1]
    assert moved.running[1].nodes == ("n1", "n2") and moved.nodes[0].free_gpus == 1
    fresh = _input(jobs, _view(1.0, ["n1", "n2"]), None)
    assert (moved.running, moved.nodes) == (fresh.running, fresh.nodes)

    leaving = JobsRead(
        queued=(), active=((_attempt("a"), False), (_attempt("b"), True)), tenants=(), new_in_queue=False
    )
    gone = _input(leaving, _view(1.0, ["n1", "n2"]), known)  # b asked to stop: its room counts as free
    assert [job.id for job in gone.running] == ["a"] and [node.free_gpus for node in gone.nodes] == [2, 4]
