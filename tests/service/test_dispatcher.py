"""The dispatcher's decisions against a fake cluster: gang admission, ordering, failures, cleanup."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import select

from harness.standin_cluster import STANDIN_NODE, StandInCluster
from ringmaster.service import jobs
from ringmaster.service.db import Database
from ringmaster.service.dispatcher import Dispatcher
from ringmaster.service.models import Attempt, Job, TenantShare
from ringmaster.service.naming import workers_fitting
from ringmaster.service.reports import SCRIPT_FINAL_UPLOAD_WAIT_S, DriverReport
from ringmaster.service.scheduling.model import PolicyName, PolicySettings
from ringmaster.service.settings import Settings
from ringmaster.service.spec import SHARED_POOL, JobSpec, RuntimeEnvSpec
from ringmaster.service.states import JobState


class FakeCluster(StandInCluster):
    """The stand-in cluster with a fixed number of CPUs, at a GCS address the entrypoint test reads back."""

    gcs_address = "10.0.0.1:6379"

    def __init__(self, cpus: int) -> None:
        super().__init__(cpus)


def _spec(name: str, workers: int, priority: int = 0) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": name,
            "model": "mlp",
            "priority": priority,
            "workers": {"min": workers, "max": workers},
            "train": {"steps": 5, "global_batch_size": 4 * workers, "micro_batch_size": 4},
        }
    )


def _submit(db: Database, spec: JobSpec) -> str:
    with db.sessions() as session, session.begin():
        return jobs.submit_job(session, spec).id


def _age_last_report(db: Database, job_id: str, seconds: float) -> None:
    """As if the current attempt's driver last reported `seconds` ago."""
    with db.sessions() as session, session.begin():
        job = session.get(Job, job_id)
        attempt = session.scalars(select(Attempt).where(Attempt.job_id == job_id, Attempt.number == job.attempt)).one()
        attempt.last_report_at -= timedelta(seconds=seconds)


def _state(db: Database, job_id: str) -> JobState:
    with db.sessions() as session:
        return JobState(session.get(Job, job_id).state)


@pytest.fixture
def dispatcher(db: Database) -> tuple[Dispatcher, FakeCluster]:
    cluster = FakeCluster(cpus=4)
    settings = Settings(api_url="http://control-plane:8765", storage_uri="/ckpt", driver_python="python3")
    return Dispatcher(db.sessions, cluster, settings, owner="test-dispatcher"), cluster


def test_job_too_large_waits_and_does_not_block_smaller_jobs(db, dispatcher):
    dispatcher, cluster = dispatcher
    big = _submit(db, _spec("big", workers=8, priority=10))
    small = _submit(db, _spec("small", workers=2))
    dispatcher.run_once()
    assert _state(db, big) == JobState.QUEUED
    assert _state(db, small) == JobState.ADMITTED
    assert cluster.free_cpus == 2 and list(cluster.groups) == [f"ringmaster-{small}-1"]


def test_a_job_the_idle_cluster_could_never_hold_says_so_and_one_that_waits_for_room_does_not(db, dispatcher):
    dispatcher, cluster = dispatcher
    running = _submit(db, _spec("running", workers=2))
    dispatcher.run_once()
    never = _submit(db, _spec("never", workers=8))
    later = _submit(db, _spec("later", workers=4))
    views = []
    read_view = cluster.cluster_view
    cluster.cluster_view = lambda groups: views.append(1) or read_view(groups)
    dispatcher.run_once()
    with db.sessions() as session:
        reasons = {job_id: session.get(Job, job_id).waiting_reason for job_id in (never, later)}
    assert _state(db, running) == JobState.ADMITTED
    assert reasons[never] == (
        "the cluster's nodes hold only 4 workers of 1 CPUs each even when idle; it needs 8: it waits for nodes to join"
    )
    assert reasons[later] == "reserved: head of the queue, waits for 2 CPUs more to free"
    assert len(views) == 1, "the cluster is read once per pass"


def test_workers_fitting_counts_each_nodes_whole_bundles() -> None:
    nodes = [{"CPU": 3.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 0.0}, {"CPU": 1.5, "GPU": 1.0}]
    assert workers_fitting(nodes, 0, 2.0) == 1 + 4 + 0
    assert workers_fitting(nodes, 1, 1.0) == 2 + 0 + 1, "a GPU worker's bundle asks for its GPUs alone"
    assert workers_fitting(nodes, 2, 1.0) == 1
    assert workers_fitting([], 0, 1.0) == 0


def test_higher_priority_then_older_job_is_admitted_first(db, dispatcher):
    dispatcher, _cluster = dispatcher
    first_low = _submit(db, _spec("low", workers=4))
    high = _submit(db, _spec("high", workers=4, priority=5))
    dispatcher.run_once()
    assert (_state(db, high), _state(db, first_low)) == (JobState.ADMITTED, JobState.QUEUED)


def test_submitted_entrypoint_carries_the_spec_and_derived_ids(db, dispatcher):
    dispatcher, cluster = dispatcher
    spec = _spec("one", workers=2)
    job_id = _submit(db, spec)
    dispatcher.run_once()
    submission_id = f"ringmaster-{job_id}-1"
    line = cluster.submitted[submission_id]
    entrypoint = line.split()
    assert entrypoint[:3] == ["python3", "-m", "ringmaster.workers.driver"]
    assert len(line) < 300 and spec.name not in line, "short and readable: the spec travels in the driver's handoff"
    handoff = cluster.handoffs[submission_id]
    assert handoff.spec == spec
    secret = handoff.report_token.get_secret_value()
    shown = json.dumps([line, cluster.runtime_envs[submission_id], cluster.metadata[submission_id]])
    assert secret not in shown and spec.model_dump_json() not in shown, "the Jobs API shows all three"
    assert cluster.metadata[submission_id] == {
        "job_name": f"one ({job_id[:8]}, attempt 1)",
        "ringmaster_job_id": job_id,
        "name": "one",
        "tenant": "default",
        "attempt": "1",
        "strategy": spec.strategy,
        "world_size": "2",
        "ringmaster_url": f"http://control-plane:8765/ui/jobs/{job_id}",
    }
    assert entrypoint[entrypoint.index("--api-url") + 1] == "http://control-plane:8765"
    assert entrypoint[entrypoint.index("--ray-address") + 1] == "10.0.0.1:6379"
    with db.sessions() as session:
        job = session.get(Job, job_id)
        assert (job.attempt, job.submission_id) == (1, submission_id)


def test_a_jobs_api_without_an_agent_yet_is_waited_out_without_counting_failures(db, dispatcher):
    """A Ray cluster still starting answers with no agent to submit to: the job waits, its max_failures untouched."""
    dispatcher, cluster = dispatcher
    cluster.refuse_submit = (
        "Request failed with status code 500: No available agent to submit job, please try again later."
    )
    job_id = _submit(db, _spec("agent-starting", workers=2).model_copy(update={"max_failures": 1}))
    for _ in range(3):
        dispatcher.run_once()
        with db.sessions() as session:
            job = session.get(Job, job_id)
            assert (job.state, job.failures) == (JobState.QUEUED, 0)
    assert cluster.free_cpus == 4, "a refused attempt holds no resources"
    cluster.refuse_submit = False
    dispatcher.run_once()
    with db.sessions() as session:
        assert session.get(Job, job_id).state == JobState.ADMITTED


def test_refused_submission_is_retried_then_fails_after_max_failures(db, dispatcher):
    dispatcher, cluster = dispatcher
    cluster.refuse_submit = True
    job_id = _submit(db, _spec("refused", workers=2).model_copy(update={"max_failures": 1}))
    dispatcher.run_once()
    with db.sessions() as session:
        job = session.get(Job, job_id)
        assert (job.state, job.failures) == (JobState.QUEUED, 1)
    assert cluster.free_cpus == 4, "a refused attempt holds no resources"
    dispatcher.run_once()
    with db.sessions() as session:
        job = session.get(Job, job_id)
        assert job.state == JobState.FAILED and "Jobs API unavailable" in job.error and "max_failures 1" in job.error
    assert cluster.free_cpus == 4


def test_ray_job_dying_without_report_is_resubmitted_as_a_new_attempt(db, dispatcher):
    dispatcher, cluster = dispatcher
    job_id = _submit(db, _spec("dies", workers=2))
    dispatcher.run_once()
    cluster.ray_status[f"ringmaster-{job_id}-1"] = "FAILED"
    dispatcher.run_once()
    with db.sessions() as session:
        job = session.get(Job, job_id)
        assert (job.state, job.attempt, job.failures) == (JobState.ADMITTED, 2, 1)
        requeued = [e for e in jobs.list_events(session, job_id).items if e.to_state == JobState.QUEUED][-1]
        assert "ended FAILED without the driver reporting" in requeued.message
        assert f"log of ringmaster-{job_id}-1" in requeued.message
    assert f"ringmaster-{job_id}-2" in cluster.submitted
    assert cluster.stopped == [f"ringmaster-{job_id}-1"], "the lost attempt's placement group is released"
    assert cluster.free_cpus == 2


def test_job_lost_more_than_max_failures_times_fails_with_the_reason(db, dispatcher):
    dispatcher, cluster = dispatcher
    spec = _spec("flaky", workers=1).model_copy(update={"max_failures": 1})
    job_id = _submit(db, spec)
    dispatcher.run_once()
    cluster.ray_status[f"ringmaster-{job_id}-1"] = "FAILED"  # the driver process was killed
    dispatcher.run_once()
    with db.sessions() as session, session.begin():
        jobs.apply_driver_report(session, job_id, 2, DriverReport(state="RUNNING"))
    _age_last_report(db, job_id, seconds=10)  # the driver went quiet: the Ray head restarted and forgot its job
    cluster.ray_status.pop(f"ringmaster-{job_id}-2")
    dispatcher.run_once()
    with db.sessions() as session:
        job = session.get(Job, job_id)
        assert job.state == JobState.FAILED and job.attempt == 2
        assert "is gone from Ray" in job.error and "max_failures 1" in job.error


def test_running_ray_job_is_adopted_not_resubmitted(db, dispatcher):
    dispatcher, cluster = dispatcher
    job_id = _submit(db, _spec("adopted", workers=2))
    dispatcher.run_once()
    restarted = Dispatcher(db.sessions, cluster, dispatcher.settings, owner="after-restart")
    restarted.run_once()
    restarted.run_once()
    assert list(cluster.submitted) == [f"ringmaster-{job_id}-1"] and cluster.duplicates == []
    assert _state(db, job_id) == JobState.ADMITTED


def test_ray_is_asked_about_a_job_only_once_adopted_and_while_its_driver_is_quiet(db, dispatcher):
    dispatcher, cluster = dispatcher
    job_id = _submit(db, _spec("reporting", workers=2))
    submission = f"ringmaster-{job_id}-1"
    dispatcher.run_once()
    with db.sessions() as session, session.begin():
        jobs.apply_driver_report(session, job_id, 1, DriverReport(state="RUNNING"))
    cluster.status_calls.clear()
    dispatcher.run_once()
    dispatcher.run_once()
    assert cluster.status_calls == [], "a driver that just reported is alive"

    restarted = Dispatcher(db.sessions, cluster, dispatcher.settings, owner="after-restart")
    restarted.run_once()
    restarted.run_once()
    assert cluster.status_calls == [submission], "a dispatcher new to the job asks Ray once, to adopt it"

    _age_last_report(db, job_id, seconds=10)
    cluster.ray_status[submission] = "FAILED"  # the driver was killed after its last report
    restarted.run_once()
    assert cluster.status_calls == [submission, submission]
    with db.sessions() as session:
        assert session.get(Job, job_id).attempt == 2, "a quiet driver's dead Ray job is found and resubmitted"


def test_cancel_stops_the_ray_job_and_frees_the_placement_group(db, dispatcher):
    dispatcher, cluster = dispatcher
    job_id = _submit(db, _spec("cancelled", workers=4))
    dispatcher.run_once()
    assert cluster.free_cpus == 0
    with db.sessions() as session, session.begin():
        jobs.cancel_job(session, job_id)
    dispatcher.run_once()
    assert cluster.stopped == [f"ringmaster-{job_id}-1"] and cluster.free_cpus == 4
    with db.sessions() as session:
        attempt = session.query(Attempt).filter_by(job_id=job_id).one()
        assert attempt.ended_at is not None and attempt.outcome == "CANCELLED"
    dispatcher.run_once()
    assert cluster.stopped == [f"ringmaster-{job_id}-1"], "a closed attempt is not stopped twice"


@pytest.mark.parametrize(
    ("storage_uri", "upload_wait_s"), [("/ckpt", 0.0), ("s3://bucket/ckpt", SCRIPT_FINAL_UPLOAD_WAIT_S)]
)
def test_a_cancelled_script_job_keeps_its_processes_for_stop_grace_s_then_is_stopped(db, storage_uri, upload_wait_s):
    """Its driver sends SIGTERM and waits stop_grace_s before SIGKILL: stopping the Ray job, or releasing its bundles,
    sooner would kill a script that saves on SIGTERM before it saved; on remote storage, before its workers uploaded
    that save."""
    cluster = FakeCluster(cpus=4)
    settings = Settings(api_url="http://control-plane:8765", storage_uri=storage_uri, driver_python="python3")
    dispatcher = Dispatcher(db.sessions, cluster, settings, owner="test-dispatcher")
    spec = JobSpec.model_validate(
        {"name": "script", "command": ["python", "train.py"], "workers": {"min": 2, "max": 2}, "stop_grace_s": 20}
    )
    job_id = _submit(db, spec)
    dispatcher.run_once()
    submission_id = f"ringmaster-{job_id}-1"
    assert cluster.metadata[submission_id]["strategy"] == "script"
    with db.sessions() as session, session.begin():
        jobs.cancel_job(session, job_id)
    dispatcher.run_once()
    assert cluster.stopped == [] and cluster.free_cpus == 2, "stopped before the script's grace"
    with db.sessions() as session, session.begin():
        job = session.get(Job, job_id)
        job.finished_at -= timedelta(seconds=spec.stop_grace_s + 16)
    dispatcher.run_once()
    if upload_wait_s:
        assert cluster.stopped == [], "stopped before the workers' final upload could end"
        with db.sessions() as session, session.begin():
            session.get(Job, job_id).finished_at -= timedelta(seconds=upload_wait_s)
        dispatcher.run_once()
    assert cluster.stopped == [submission_id] and cluster.free_cpus == 4


def test_two_dispatchers_never_admit_the_same_job(db):
    cluster = FakeCluster(cpus=64)
    settings = Settings(api_url="http://cp", storage_uri="/ckpt")
    first = Dispatcher(db.sessions, cluster, settings, owner="a")
    second = Dispatcher(db.sessions, cluster, settings, owner="b")
    ids = [_submit(db, _spec(f"job-{index}", workers=1)) for index in range(12)]
    threads = [threading.Thread(target=d.dispatch_queued) for d in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(cluster.submitted) == sorted(f"ringmaster-{job_id}-1" for job_id in ids)
    assert cluster.duplicates == [] and cluster.free_cpus == 64 - 12
    assert {_state(db, job_id) for job_id in ids} == {JobState.ADMITTED}


def test_warm_pools_are_the_shared_one_and_the_newest_runtime_envs_a_job_ran_in(db, dispatcher):
    """A pool per runtime env: the shared one, and one for each of the `warm_runtime_envs` newest envs of their own
    whose job ran (one whose env could not even be set up would fail every pool worker too)."""
    dispatcher, cluster = dispatcher
    dispatcher.settings = dispatcher.settings.model_copy(update={"warm_runtime_envs": 2})
    ids = {}
    for name, state in [
        ("old", JobState.SUCCEEDED),
        ("a", JobState.SUCCEEDED),
        ("again-a", JobState.RUNNING),
        ("b", JobState.RUNNING),
        ("plain", JobState.SUCCEEDED),
        ("broken", JobState.FAILED),
    ]:
        project = name.removeprefix("again-")
        spec = (
            _spec(name, workers=1)
            if name == "plain"
            else _spec(name, workers=1).model_copy(
                update={"runtime_env": RuntimeEnvSpec(env_vars={"PROJECT": project})}
            )
        )
        ids[name] = _submit(db, spec)
        with db.sessions() as session, session.begin():
            session.get(Job, ids[name]).state = state
    dispatcher.keep_pool_warm()
    pools = cluster.warm_pool_envs

    def pool_of(name: str) -> str:
        with db.sessions() as session:
            return JobSpec.model_validate(session.get(Job, ids[name]).spec).warm_pool

    assert pool_of("a") == pool_of("again-a") != pool_of("b") and pool_of("plain") == SHARED_POOL
    assert sorted(pools) == sorted([SHARED_POOL, pool_of("a"), pool_of("b")]), (
        "the two newest envs that ran, and the shared one"
    )
    assert pools[pool_of("b")] == {"env_vars": {"PROJECT": "b"}} and pools[SHARED_POOL] == {}
    assert not any(name.startswith("RINGMASTER_") for env in pools.values() for name in env.get("env_vars", {})), (
        "nothing of the control plane's in a pool"
    )


def test_warm_pool_upkeep_names_the_active_attempts_and_never_stops_admission(db, dispatcher):
    dispatcher, cluster = dispatcher
    running = _submit(db, _spec("running", workers=2))
    dispatcher.run_once()
    with db.sessions() as session:
        submission = session.get(Job, running).submission_id
    assert cluster.warm_pool_calls == [(dispatcher.settings.warm_workers_per_node, {submission})]

    dispatcher.run_once()  # within the upkeep interval: no second call
    assert len(cluster.warm_pool_calls) == 1

    def broken(*_):
        raise RuntimeError("GCS unreachable")

    cluster.keep_warm = broken
    dispatcher._warm_pool_due = 0.0
    queued = _submit(db, _spec("queued", workers=2))
    dispatcher.run_once()
    assert _state(db, queued) == JobState.ADMITTED


# -- the plan: one read, one plan, preemption ------------------------------------------------------------------------


def _preempting_dispatcher(db: Database, cpus: int = 4, **settings: float) -> tuple[Dispatcher, FakeCluster]:
    cluster = FakeCluster(cpus=cpus)
    configured = Settings(
        api_url="http://control-plane:8765",
        storage_uri="/ckpt",
        driver_python="python3",
        min_run_before_preemption_s=0,
        **settings,
    )
    return Dispatcher(db.sessions, cluster, configured, owner="test-dispatcher"), cluster


def _report(db: Database, job_id: str, seq: int, state: str | None = None) -> jobs.ReportResult:
    with db.sessions() as session, session.begin():
        attempt = session.get(Job, job_id).attempt
        return jobs.apply_driver_report(session, job_id, attempt, DriverReport(seq=seq, state=state))


def _finish(db: Database, cluster: FakeCluster, job_id: str) -> None:
    """The job's driver reports SUCCEEDED and its Ray job ends."""
    _report(db, job_id, 90, "SUCCEEDED")
    with db.sessions() as session:
        cluster.ray_status[session.get(Job, job_id).submission_id] = "SUCCEEDED"


def test_freed_capacity_goes_to_the_high_priority_job_not_to_one_of_twenty_low_ones_queued_before_it(db):
    """The priority inversion of issue 47: one pass reads the cluster once and plans, so the priority-9 job, the head
    of the queue, gets the room a finished job frees; placement groups are made only for admitted jobs."""
    dispatcher, cluster = _preempting_dispatcher(db, cpus=2, scheduling_policy="backfill")
    running = _submit(db, _spec("running", workers=2))
    dispatcher.run_once()
    _report(db, running, 1, "RUNNING")
    lows = [_submit(db, _spec(f"low-{index}", workers=2)) for index in range(20)]
    high = _submit(db, _spec("high", workers=2, priority=9))
    reserved = []
    reserve = cluster.reserve
    cluster.reserve = lambda name, bundles, wait_s: reserved.append(name) or reserve(name, bundles, wait_s)
    dispatcher.run_once()
    assert reserved == [], "no placement group is tried for a job the plan does not admit"
    with db.sessions() as session:
        positions = {job_id: session.get(Job, job_id).queue_position for job_id in [high, *lows]}
        assert session.get(Job, high).waiting_reason.startswith("reserved: head of the queue")
    assert positions == {job_id: position for position, job_id in enumerate([high, *lows], start=1)}
    _finish(db, cluster, running)
    dispatcher.run_once()
    assert _state(db, high) == JobState.ADMITTED
    assert [_state(db, low) for low in lows] == [JobState.QUEUED] * 20
    assert reserved == [f"ringmaster-{high}-1"]


def test_a_low_priority_job_is_preempted_whole_then_queued_again_in_its_place_and_resumes_without_a_failure(db):
    dispatcher, cluster = _preempting_dispatcher(db)
    low = _submit(db, _spec("low", workers=4).model_copy(update={"max_failures": 0}))
    dispatcher.run_once()
    _report(db, low, 1, "RUNNING")
    high = _submit(db, _spec("high", workers=4, priority=9))
    dispatcher.run_once()
    assert (_state(db, low), _state(db, high)) == (JobState.RUNNING, JobState.QUEUED)
    answer = _report(db, low, 2)
    assert (answer.accepted, answer.preempting, answer.preempted_for) == (True, True, high)
    dispatcher.run_once()
    assert _state(db, high) == JobState.QUEUED, "it starts once the preempted job has saved and freed its room"
    assert cluster.free_cpus == 0
    stopped = _report(db, low, 3, "PREEMPTED")
    assert (stopped.state, stopped.accepted) == (JobState.PREEMPTED, False), "the driver's attempt is over"
    cluster.ray_status[f"ringmaster-{low}-1"] = "SUCCEEDED"  # the driver exited after its report
    dispatcher.run_once()
    with db.sessions() as session:
        job = session.get(Job, low)
        assert (job.state, job.failures, job.preemptions, job.preempted_for) == (JobState.QUEUED, 0, 1, high)
        assert job.queue_position == 1 and job.waiting_reason.startswith("reserved: head of the queue")
        events = [event.to_state for event in jobs.list_events(session, low).items if event.kind == "transition"]
    assert events[-2:] == [JobState.PREEMPTED, JobState.QUEUED]
    assert _state(db, high) == JobState.ADMITTED
    _report(db, high, 1, "RUNNING")
    _finish(db, cluster, high)
    dispatcher.run_once()
    dispatcher.run_once()
    with db.sessions() as session:
        job = session.get(Job, low)
        assert (job.state, job.attempt, job.failures) == (JobState.ADMITTED, 2, 0), "resumed as a new attempt"


def test_a_preempted_driver_that_does_not_stop_in_time_is_stopped_and_its_job_queued_again(db):
    dispatcher, cluster = _preempting_dispatcher(db, preemption_timeout_s=30)
    low = _submit(db, _spec("low", workers=4))
    dispatcher.run_once()
    _report(db, low, 1, "RUNNING")
    high = _submit(db, _spec("high", workers=4, priority=9))
    dispatcher.run_once()
    with db.sessions() as session, session.begin():
        session.get(Job, low).preempt_requested_at -= timedelta(seconds=31)
    dispatcher.run_once()  # overdue: PREEMPTED, the attempt stopped and closed, the job queued again
    assert cluster.stopped == [f"ringmaster-{low}-1"]
    with db.sessions() as session:
        job = session.get(Job, low)
        assert (job.state, job.failures, job.preemptions) == (JobState.QUEUED, 0, 1)
    dispatcher.run_once()
    assert _state(db, high) == JobState.ADMITTED


def test_a_job_that_is_not_preemptible_or_of_equal_priority_is_never_preempted(db):
    dispatcher, _ = _preempting_dispatcher(db)
    pinned = _submit(db, _spec("pinned", workers=2).model_copy(update={"preemptible": False}))
    peer = _submit(db, _spec("peer", workers=2, priority=9))
    dispatcher.run_once()
    waiting = _submit(db, _spec("waiting", workers=2, priority=9))
    dispatcher.run_once()
    dispatcher.run_once()
    with db.sessions() as session:
        assert [session.get(Job, job_id).preempt_requested_at for job_id in (pinned, peer)] == [None, None]
        assert session.get(Job, waiting).state == JobState.QUEUED


def test_a_job_is_not_preempted_before_it_has_run_min_run_before_preemption_s(db):
    dispatcher, _ = _preempting_dispatcher(db)
    dispatcher.settings = dispatcher.settings.model_copy(update={"min_run_before_preemption_s": 3600})
    low = _submit(db, _spec("low", workers=4))
    dispatcher.run_once()
    high = _submit(db, _spec("high", workers=4, priority=9))
    dispatcher.run_once()
    with db.sessions() as session:
        assert session.get(Job, low).preempt_requested_at is None
        assert session.get(Job, high).waiting_reason.endswith(f"job {low} may give way in 3600 s")


def test_each_pass_samples_every_tenants_standing_for_the_queue_view_at_most_every_few_seconds(db):
    dispatcher, _ = _preempting_dispatcher(db)
    running = _submit(db, _spec("running", workers=3))
    dispatcher.run_once()  # admits it, and samples the standing before
    _report(db, running, 1, "RUNNING")
    waiting = _submit(db, _spec("waiting", workers=2).model_copy(update={"priority": -1}))
    with db.sessions() as session, session.begin():
        session.get(Job, waiting).tenant = "team-b"
    dispatcher.run_once()
    with db.sessions() as session:
        assert [row.tenant for row in session.scalars(select(TenantShare))] == ["default"], "one sample so far"
    dispatcher._share_sample_due = 0.0  # as if the sampling interval had passed
    dispatcher.run_once()
    with db.sessions() as session:
        rows = list(session.scalars(select(TenantShare).order_by(TenantShare.id)))
    assert [row.tenant for row in rows] == ["default", "default", "team-b"]
    held, other = rows[1], rows[2]
    assert (held.held_cpus, held.share, held.entitled_share) == (3.0, 0.75, 0.5)
    assert 0 < held.decayed_share < 0.75, "the decayed share rises toward the share held"
    assert (other.held_cpus, other.share, other.entitled_share) == (0.0, 0.0, 0.5)


def test_the_autoscaler_is_asked_for_the_running_jobs_and_the_queue_within_quota_and_cleared_once_it_is_empty(db):
    dispatcher, cluster = _preempting_dispatcher(db, cpus=4)
    running = _submit(db, _spec("running", workers=3))
    dispatcher.run_once()
    _report(db, running, 1, "RUNNING")
    waiting = _submit(db, _spec("waiting", workers=2))
    dispatcher.run_once()
    dispatcher.run_once()
    assert cluster.resource_requests[-1] == [{"CPU": 1.0}] * 5, "3 running, and 2 for the job that waits for a node"
    assert cluster.resource_requests.count(cluster.resource_requests[-1]) == 1, "sent once, not at every pass"
    with db.sessions() as session, session.begin():
        jobs.cancel_job(session, waiting)
    dispatcher.run_once()
    assert cluster.resource_requests[-1] == [], "nothing queued: the request is cleared"


def test_the_queues_places_and_reasons_are_written_in_one_statement_however_long_the_queue(db):
    """Each admission moves every job behind it up one place: a pass writes the changed rows in one batch."""
    from sqlalchemy import event

    dispatcher, _ = _preempting_dispatcher(db, cpus=2, scheduling_policy="backfill")
    running = _submit(db, _spec("running", workers=2))
    dispatcher.run_once()
    _report(db, running, 1, "RUNNING")
    waiting = [_submit(db, _spec(f"waiting-{index}", workers=2)) for index in range(300)]
    statements: list[str] = []
    event.listen(db.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    dispatcher.run_once()
    updates = [statement for statement in statements if statement.lstrip().upper().startswith("UPDATE JOBS")]
    assert len(updates) == 1, updates
    with db.sessions() as session:
        places = [session.get(Job, job_id).queue_position for job_id in waiting]
    assert places == list(range(1, 301))


def test_a_pass_reads_only_the_specs_of_jobs_new_to_the_queue_and_sees_who_joined_and_left(db):
    """The dispatcher keeps each queued job's shape between passes: a later pass reads the spec of the one job
    submitted since, and plans without the one cancelled since (the new priority-5 job moves to the front)."""
    from sqlalchemy import event

    dispatcher, _ = _preempting_dispatcher(db, cpus=2, scheduling_policy="backfill")
    running = _submit(db, _spec("running", workers=2))
    dispatcher.run_once()
    _report(db, running, 1, "RUNNING")
    waiting = [_submit(db, _spec(f"waiting-{index}", workers=2)) for index in range(5)]
    dispatcher.dispatch_queued()
    with db.sessions() as session, session.begin():
        jobs.cancel_job(session, waiting[0])
    urgent = _submit(db, _spec("urgent", workers=2, priority=5))
    statements: list[tuple[str, object]] = []
    event.listen(db.engine, "before_cursor_execute", lambda *args: statements.append((args[2], args[3])))
    dispatcher._queue_record_due = 0.0  # record the queue at this pass, not two seconds later
    dispatcher.dispatch_queued()
    # The bound values: a tuple on SQLite, a dict by parameter name on PostgreSQL.
    spec_reads = [
        set(parameters.values() if isinstance(parameters, dict) else parameters)
        for statement, parameters in statements
        if "jobs.spec" in statement
    ]
    assert len(spec_reads) == 1 and urgent in spec_reads[0] and not set(waiting) & spec_reads[0], spec_reads
    with db.sessions() as session:
        places = [session.get(Job, job_id).queue_position for job_id in [urgent, *waiting[1:]]]
    assert places == [1, 2, 3, 4, 5]


def test_the_plan_takes_every_scheduling_setting_of_the_service():
    """What an operator tries with `ringmaster simulate --setting` is what the settings of those names set live."""
    from ringmaster.service.dispatch_plan import policy_settings

    configured = Settings(
        scheduling_policy="las",
        min_run_before_preemption_s=11,
        min_resize_interval_s=12,
        fair_share_half_life_s=13,
        reserve_after_s=14,
        hold_after_s=15,
        fair_share_preemption_above=1.5,
    )
    assert policy_settings(configured) == PolicySettings(
        name=PolicyName.LAS,
        min_run_s=11,
        min_resize_interval_s=12,
        fair_share_half_life_s=13,
        reserve_after_s=14,
        hold_after_s=15,
        fair_share_preemption_above=1.5,
    )


def test_a_job_on_a_draining_node_is_asked_to_save_and_stop_even_with_nothing_queued_naming_node_and_deadline(db):
    """A drain (Ray's `ray drain-node`, or POST /v1/nodes/{id}/drain) moves the jobs on the node off it: with nothing
    queued, the dispatcher still looks up Ray's drains (every _DRAIN_CHECK_INTERVAL_S) and plans; a job at its
    workers.min is preempted (it saves at its next step and resumes elsewhere), not counted as a failure."""
    dispatcher, cluster = _preempting_dispatcher(db)
    job = _submit(db, _spec("on-the-node", workers=2))
    dispatcher.run_once()
    _report(db, job, 1, "RUNNING")
    dispatcher.run_once()
    assert _report(db, job, 2).preempting is False, "no drain: nothing asks it to stop"
    checks = cluster.drain_checks
    cluster.draining[STANDIN_NODE] = time.time() + 120
    dispatcher._drain_check_due = 0.0  # the next look is due
    dispatcher.run_once()
    assert cluster.drain_checks == checks + 1
    answer = _report(db, job, 3)
    assert (answer.preempting, answer.preempted_for) == (True, None)
    with db.sessions() as session:
        [asked] = [e for e in jobs.list_events(session, job).items if e.message.startswith("preempting:")]
    assert f"its node {STANDIN_NODE[:12]} is draining, which goes in 1" in asked.message, asked.message
    assert asked.message.endswith("it moves off it; it saves its state and stops at its next step")
    stopped = _report(db, job, 4, "PREEMPTED")
    assert stopped.state == JobState.PREEMPTED
    cluster.ray_status[f"ringmaster-{job}-1"] = "SUCCEEDED"
    dispatcher.run_once()
    with db.sessions() as session:
        row = session.get(Job, job)
        assert (row.state, row.failures, row.preemptions) == (JobState.QUEUED, 0, 1)
        assert "waits for nodes to join" in row.waiting_reason, "the draining node takes nothing new"
    assert cluster.free_cpus == 4 and not [name for name in cluster.groups if job in name], "its room was freed"


def test_with_no_drain_and_nothing_queued_a_pass_reads_no_cluster_beyond_the_drain_check(db):
    dispatcher, cluster = _preempting_dispatcher(db)
    job = _submit(db, _spec("alone", workers=2))
    dispatcher.run_once()
    _report(db, job, 1, "RUNNING")
    views = []
    cluster.cluster_view = lambda groups: views.append(groups)  # type: ignore[method-assign]
    dispatcher._share_sample_due = float("inf")
    for _ in range(3):
        dispatcher._drain_check_due = 0.0
        dispatcher.run_once()
    assert cluster.drain_checks == 3 and views == []


def test_a_drain_noted_through_the_api_is_planned_for_at_the_next_pass_without_waiting_for_the_lookup(db):
    dispatcher, cluster = _preempting_dispatcher(db)
    job = _submit(db, _spec("on-the-node", workers=2))
    dispatcher.run_once()
    _report(db, job, 1, "RUNNING")
    dispatcher.run_once()
    checks = cluster.drain_checks
    dispatcher.note_drain(STANDIN_NODE, None)  # as ControlPlane.drain_node does once Ray accepted the drain
    dispatcher.run_once()
    assert cluster.drain_checks == checks, "no lookup was due: the noted drain was planned for"
    answer = _report(db, job, 2)
    assert (answer.preempting, answer.preempted_for) == (True, None)
    with db.sessions() as session:
        [asked] = [e for e in jobs.list_events(session, job).items if e.message.startswith("preempting:")]
    assert f"its node {STANDIN_NODE[:12]} is draining; it moves off it" in asked.message, asked.message
