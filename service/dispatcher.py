"""The dispatcher: claims queued jobs, admits them gang-shaped onto Ray, and watches them run.

Each pass (1) resubmits jobs whose Ray job died without the driver reporting (or fails them, once, when the driver
never started: its runtime env could not be set up, or it exited with an error before its first report), (2) closes
attempts that ended, were superseded or preempted (stop the Ray job, free its placement group; a preempted job goes
back to the queue), and (3) plans: one read of the queue and the cluster, one plan (service/scheduling/plan.py, the
settings' scheduling_policy) of which jobs start at which size and which lower-priority jobs are preempted for them,
and a placement group only for a job the plan admits. A job that must wait keeps its place and the plan's reason.
Several dispatchers may run against one database: the queue lease keeps them apart.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from ringmaster.service import auth, code_store, dispatch_plan, jobs, queue, queue_view, telemetry, tenants
from ringmaster.service.driver_handoff import DriverHandoff
from ringmaster.service.errors import CodeNotFound
from ringmaster.service.models import Attempt, Job, utcnow
from ringmaster.service.naming import placement_group_name, submission_id_for, worker_bundles
from ringmaster.service.ray_agent import ClusterUnreachable
from ringmaster.service.ray_cluster import ClusterBackend
from ringmaster.service.reports import SCRIPT_FINAL_UPLOAD_WAIT_S
from ringmaster.service.scheduling.fair_share import FairShareLedger
from ringmaster.service.scheduling.plan import plan
from ringmaster.service.settings import Settings
from ringmaster.service.spec import SHARED_POOL, JobSpec
from ringmaster.service.states import ACTIVE, JobState

log = logging.getLogger(__name__)

_RAY_TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
_LOG_TAIL = 4000
_JOBS_AGENT_NOT_READY = "No available agent to submit job"  # Ray's Jobs API, before any node's agent has registered
_DRIVER_EXIT_GRACE_S = 30.0
_SCRIPT_STOP_MARGIN_S = 15.0  # a cancelled script job's driver: to hear of the cancel, and to end after the grace
_SUBMIT_GRACE_S = 30.0
_WARM_POOL_INTERVAL_S = 2.0
# Ray's autoscaler is asked to make room for at most this many worker bundles at once (running and queued together).
AUTOSCALER_BUNDLES = 10_000
_SHARE_SAMPLE_INTERVAL_S = 10.0
# While jobs run, Ray is asked this often which nodes it drains (a drain made through ringmaster is known at once). Not
# more often: while a placement group has a bundle Ray cannot place (a job that lost a node and trains on without it),
# each such query adds to the GCS's busy retrying of it (a 4-to-3 shrink test slowed from 75 s to a hang when asked
# every 2 s).
_DRAIN_CHECK_INTERVAL_S = 10.0
# The queue's places and reasons are written at most this often, besides after a pass that admitted a job or found a
# job not placed yet (a job's first reason comes at once).
_QUEUE_RECORD_INTERVAL_S = 2.0  # each tenant's standing is recorded this often (the queue view's chart)
_RECENT_JOBS_FOR_POOLS = 50  # the runtime envs that keep a warm pool are found among this many newest jobs
_RAN_IN_ITS_ENV = [JobState.RUNNING.value, JobState.RECOVERING.value, JobState.SUCCEEDED.value]
# A driver reports every second while its job trains; one that reported this recently is not asked after in Ray.
_REPORTING_DRIVER_ALIVE_S = 3.0
# Whether the plan may shrink and grow running jobs: until their drivers resize on the control plane's word, a running
# job counts as at its workers.min, so a plan preempts it whole rather than shrinking it (and its driver grows itself
# onto idle capacity, as before).
LIVE_RESIZES = False


def newest_jobs_that_ran_in_an_env_of_their_own(session: Session) -> list[tuple[str, JobSpec]]:
    """(tenant, spec) of each job with code or a runtime_env of its own that ran in it, newest first, among the
    `_RECENT_JOBS_FOR_POOLS` newest jobs. Only envs a job has run in: one that could not be set up (a failed pip
    install) would fail each pool worker too. The state is checked here, not in SQL: filtered there, SQLite searches
    the queue index for every job in those states and sorts them all (12 ms at 100,000 jobs, every upkeep), where
    the newest few are read straight from the end of the created_at index."""
    rows = session.execute(
        select(Job.tenant, Job.state, Job.spec).order_by(Job.created_at.desc()).limit(_RECENT_JOBS_FOR_POOLS)
    )
    return [
        (tenant, JobSpec.model_validate(raw))
        for tenant, state, raw in rows
        if state in _RAN_IN_ITS_ENV and (raw.get("code") or raw.get("runtime_env"))
    ]


class Dispatcher:
    def __init__(
        self, sessions: sessionmaker[Session], cluster: ClusterBackend, settings: Settings, owner: str | None = None
    ) -> None:
        self.sessions = sessions
        self.cluster = cluster
        self.settings = settings
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._wake = threading.Event()
        # Submission ids this process has logged as alive, so adoption is logged once (not each pass).
        self._seen_alive: set[str] = set()
        self._warm_pool_due = 0.0
        self._code_zips: dict[tuple[str, str], Path] = {}  # (tenant, code ref) -> its local zip
        # Each tenant's decayed share of the cluster, fed at every pass; kept in this process (a restarted dispatcher
        # starts every tenant at 0, and the shares rebuild within a half-life).
        self._ledger = FairShareLedger(settings.fair_share_half_life_s, start=time.time())
        self._share_sample_due = 0.0
        self._queue_record_due = 0.0
        self._drain_check_due = 0.0
        # The nodes Ray drains (id -> deadline, None: none given), as last looked up or noted; the API's thread notes.
        self._drains: dict[str, float | None] = {}
        self._new_drain = False
        self._drains_lock = threading.Lock()
        self._autoscaler_request: list[dict[str, float]] | None = None  # the bundles last sent to request_resources
        self._known_jobs = dispatch_plan.KnownJobs()  # each queued and active job's shape, read once

    def run_once(self) -> None:
        self.watch_active_jobs()
        self.end_overdue_preemptions()
        self.close_finished_attempts()  # after watching, so a lost attempt's resources are free for its retry
        self.dispatch_queued()
        self.keep_pool_warm()

    def keep_pool_warm(self) -> None:
        """Every few seconds: top up the cluster's warm worker pool, and reap pool workers of attempts that ended."""
        if time.monotonic() < self._warm_pool_due:
            return
        self._warm_pool_due = time.monotonic() + _WARM_POOL_INTERVAL_S
        try:
            with self.sessions() as session:
                submissions = select(Job.submission_id).where(
                    Job.state.in_([s.value for s in ACTIVE]), Job.submission_id.is_not(None)
                )
                active = cast(set[str], set(session.scalars(submissions)))  # no None: the query leaves them out
                runtime_envs = self._warm_pool_envs(session)
            self.cluster.keep_warm(self.settings.warm_workers_per_node, active, runtime_envs)
        except ClusterUnreachable as error:
            log.warning("warm pool upkeep skipped: %s", error)
        except Exception:
            log.exception("warm pool upkeep failed")

    def _warm_pool_envs(self, session: Session) -> dict[str, dict[str, Any]]:
        """pool -> the runtime_env its workers start in: the shared pool, and one for each of the
        `warm_runtime_envs` distinct envs of their own most recently submitted (read from the database each time, so
        every dispatcher replica keeps the same pools)."""
        pools: dict[str, dict[str, Any]] = {SHARED_POOL: self._shared_runtime_env()}
        if self.settings.warm_runtime_envs == 0:
            return pools
        wanted = self.settings.warm_runtime_envs + 1
        for tenant, spec in newest_jobs_that_ran_in_an_env_of_their_own(session):
            if spec.warm_pool in pools or spec.workers.gpus_per_worker:  # GPU workers are never pooled
                continue
            try:
                pools[spec.warm_pool] = self._own_runtime_env(session, tenant, spec)
            except CodeNotFound:
                continue
            if len(pools) == wanted:
                break
        return pools

    def _shared_runtime_env(self) -> dict[str, Any]:
        return {"env_vars": {"PYTHONPATH": self.settings.code_path}} if self.settings.code_path else {}

    def wake(self) -> None:
        """Start the next pass now (a job was submitted or cancelled in this process)."""
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        """Loop until stop is set; a failing pass is logged and retried, never fatal."""
        while not stop.is_set():
            self._wake.clear()
            try:
                self.run_once()
            except ClusterUnreachable as error:
                log.warning("dispatcher pass cut short, retried: %s", error)
            except Exception:
                log.exception("dispatcher pass failed")
            self._wake.wait(self.settings.dispatch_interval_s)

    # -- admission ---------------------------------------------------------------------------

    def dispatch_queued(self) -> None:
        """One scheduling pass: read the queue, the running jobs and the cluster once, plan (service/scheduling), then
        carry the plan out: ask the jobs it preempts to save and stop, admit the jobs it starts (a placement group
        only for those), and record every queued job's place and why it waits."""
        sample_due = time.monotonic() >= self._share_sample_due
        now = time.time()
        with self.sessions() as session:
            jobs_read = self._known_jobs.read(session, now)
        draining = self._drains_changed(bool(jobs_read.active))
        if not jobs_read.queued:
            self._ask_autoscaler([])  # nothing waits: the nodes it asked for are not held for nothing
            if not (sample_due and jobs_read.active) and not draining:
                return
        groups = [attempt.placement_group for attempt, _ in jobs_read.active if attempt.placement_group]
        view = self.cluster.cluster_view(groups)
        with self._drains_lock:
            for node in view["nodes"]:
                if node["id"] in self._drains:
                    node["draining"], node["drain_deadline"] = True, self._drains[node["id"]]
        state = dispatch_plan.pass_input(
            jobs_read,
            view,
            dispatch_plan.policy_settings(self.settings),
            self._ledger,
            now,
            resizable=LIVE_RESIZES,
            known=self._known_jobs,
        )
        if sample_due:
            self._share_sample_due = time.monotonic() + _SHARE_SAMPLE_INTERVAL_S
            with self.sessions() as session, session.begin():
                queue_view.record_shares(session, utcnow(), dispatch_plan.share_samples(state))
        if not jobs_read.queued and not draining:
            return
        decided = plan(state)
        if jobs_read.queued:
            self._ask_autoscaler(dispatch_plan.autoscaler_request(state, decided, AUTOSCALER_BUNDLES))
        for preemption in decided.preemptions:
            self._preempt(preemption.job_id, preemption.for_job, dispatch_plan.drain_reason(state, preemption, now))
        admitted_any = False
        for job_id, size in dispatch_plan.admission_sizes(decided).items():
            job = queue.claim(self.sessions, job_id, self.owner, self.settings.lease_s)
            if job is None:
                continue  # cancelled, or another dispatcher admits it
            admitted_any = True
            reason: str | None = None
            try:
                reason = self._admit(job, size)
            finally:
                if reason is not None:
                    queue.release(self.sessions, job.id, self.owner, reason)
                    self._known_jobs.written_elsewhere(job.id)
        if admitted_any or jobs_read.new_in_queue or time.monotonic() >= self._queue_record_due:
            self._queue_record_due = time.monotonic() + _QUEUE_RECORD_INTERVAL_S
            with self.sessions() as session, session.begin():
                dispatch_plan.record_queue(session, decided, self._known_jobs)

    def _ask_autoscaler(self, bundles: list[dict[str, float]]) -> None:
        """The one writer of Ray's request_resources: sent when it changes (and once at start, clearing what an earlier
        dispatcher asked for). An autoscaler that cannot be told now is told at a later pass."""
        if bundles == self._autoscaler_request:
            return
        try:
            self.cluster.request_resources(bundles)
        except Exception as error:
            log.warning("could not tell the autoscaler what the queue needs: %s", error)
            return
        self._autoscaler_request = bundles

    def note_drain(self, node_id: str, deadline: float | None) -> None:
        """A drain made through ringmaster (POST /v1/nodes/{id}/drain): planned for at the next pass, which starts
        now."""
        with self._drains_lock:
            self._drains[node_id] = deadline
            self._new_drain = True
        self.wake()

    def _drains_changed(self, jobs_active: bool) -> bool:
        """Whether a pass should plan for drains: Ray's drains (however made: `ray drain-node`, the autoscaler, this
        API) are looked up every _DRAIN_CHECK_INTERVAL_S while jobs run; True when they hold a node not known to drain
        before, or one was noted here since the last pass. Passes with a queue plan anyway, with the drains known."""
        with self._drains_lock:
            changed, self._new_drain = self._new_drain, False
        if jobs_active and time.monotonic() >= self._drain_check_due:
            self._drain_check_due = time.monotonic() + _DRAIN_CHECK_INTERVAL_S
            draining = self.cluster.draining_nodes()
            with self._drains_lock:
                changed = changed or not set(draining) <= set(self._drains)
                self._drains = draining
        return changed

    def _preempt(self, job_id: str, for_job: str | None, drain_reason: str | None) -> None:
        """Ask a running job's driver to save at its next step and stop; the plan that preempts it admits `for_job`
        once the room is free (for a drain, it resumes elsewhere). The driver that does not report PREEMPTED in
        preemption_timeout_s is stopped."""
        reason = drain_reason or f"job {for_job} of higher priority needs its workers"
        with self.sessions() as session, session.begin():
            job = session.get(Job, job_id)
            if job is None or not jobs.request_preemption(session, job, for_job, reason):
                return
            telemetry.record_preemption(session, job)
        log.info("job %s preempted: %s", job_id, reason, extra={"job_id": job_id, "preempted_for": for_job})

    def end_overdue_preemptions(self) -> None:
        """A preempted job whose driver did not save and stop in time: its attempt is stopped (closing it frees the
        room) and it resumes from its latest checkpoint."""
        overdue_since = utcnow() - timedelta(seconds=self.settings.preemption_timeout_s)
        with self.sessions() as session, session.begin():
            overdue = session.scalars(
                select(Job).where(
                    Job.state.in_([s.value for s in ACTIVE]),
                    Job.preempt_requested_at.is_not(None),
                    Job.preempt_requested_at < overdue_since,
                )
            ).all()
            for job in overdue:
                jobs.preempted(
                    session,
                    job,
                    f"preempted: the driver did not save and stop within {self.settings.preemption_timeout_s:g} s; "
                    "its attempt is stopped, and it resumes from its latest checkpoint",
                )

    def _admit(self, job: Job, size: int) -> str | None:
        """Grant the tenant's quota, reserve the gang at the size the plan gave, record the attempt, submit the Ray
        job.

        None when the job was admitted (or was cancelled meanwhile); otherwise why it cannot start now.
        """
        spec = JobSpec.model_validate(job.spec)
        with self.sessions() as session:
            granted = tenants.grant(session, job, spec)
        if granted.max_workers is None:
            return granted.reason  # checked before reserving: a job over quota takes no cluster capacity
        attempt = job.attempt + 1
        group_name = placement_group_name(job.id, attempt)
        world_size = min(size, granted.max_workers)
        bundles = worker_bundles(spec.workers.gpus_per_worker, spec.workers.cpus_per_worker, world_size)
        if not self.cluster.reserve(group_name, bundles, self.settings.admission_wait_s):
            workers = spec.workers
            return (
                f"waiting for cluster capacity: {world_size} worker(s) of {workers.cpus_per_worker:g} CPU and "
                f"{workers.gpus_per_worker} GPU each fit the plan, but Ray has not freed the room yet (a preempted "
                "job still saving, or a job ending)"
            )
        submission_id = submission_id_for(job.id, attempt)
        report_token, report_token_hash = auth.new_report_token()
        with self.sessions() as session, session.begin():
            current = session.get(Job, job.id, with_for_update=True)
            if current is None or current.state != JobState.QUEUED or current.lease_owner != self.owner:
                self.cluster.release(group_name)  # cancelled or taken over while we reserved
                return None
            # Again under the tenant's row lock: another dispatcher may have granted part of its quota meanwhile.
            granted = tenants.grant(session, current, spec, lock=True)
            if granted.max_workers is None or granted.max_workers < world_size:
                self.cluster.release(group_name)
                return granted.reason or f"over quota: {world_size} workers no longer fit the tenant's quota"
            jobs.mark_admitted(
                session,
                current,
                attempt,
                submission_id,
                group_name,
                world_size,
                max_workers=granted.max_workers,
                report_token_hash=report_token_hash,
            )
        try:
            driver_spec = _capped(spec, granted.max_workers)
            self.cluster.submit(
                submission_id,
                self._entrypoint(current, attempt, group_name),
                self._runtime_env(current, spec),
                self._metadata(current, attempt, driver_spec, world_size),
                DriverHandoff(report_token=report_token, spec=driver_spec),
            )
            self._seen_alive.add(submission_id)  # started here: watching it later is not an adoption
        except CodeNotFound as error:  # checked at submit and never deleted: no retry would find it either
            self.cluster.release(group_name)
            self._fail(job.id, submission_id, f"attempt {attempt}: {error}")
            return None
        except Exception as error:
            log.warning("Ray refused job %s attempt %d: %s", job.id, attempt, error, extra={"job_id": job.id})
            self.cluster.release(group_name)
            with self.sessions() as session, session.begin():
                current = session.get(Job, job.id, with_for_update=True)
                if current is not None and current.state == JobState.ADMITTED:
                    # Retried at the next pass, counted against max_failures; but a cluster whose Jobs API has no
                    # agent yet (its nodes still starting) says nothing of the job: waited out, not counted.
                    jobs.requeue(
                        session,
                        current,
                        f"Ray refused the job: {error}",
                        failure=_JOBS_AGENT_NOT_READY not in str(error),
                    )
            return f"Ray refused the job: {error}"  # retried at the next pass, not in this one
        log.info(
            "job %s attempt %d submitted to Ray as %s on %d worker(s)",
            job.id,
            attempt,
            submission_id,
            world_size,
            extra={"job_id": job.id, "attempt": attempt, "submission_id": submission_id},
        )
        return None

    def _runtime_env(self, job: Job, spec: JobSpec) -> dict[str, Any]:
        """The Ray job's runtime_env, which its driver and every worker actor it starts inherit: the job's own (below)
        or the shared one. Nothing secret: the dashboard's Jobs API shows it (the attempt's secret and spec go in its
        DriverHandoff)."""
        with self.sessions() as session:
            return (
                self._own_runtime_env(session, job.tenant, spec)
                if spec.has_own_runtime_env
                else self._shared_runtime_env()
            )

    def _own_runtime_env(self, session: Session, tenant: str, spec: JobSpec) -> dict[str, Any]:
        """The runtime env of a job that brings its own, as its warm pool's workers start in it too: the spec's
        variables and pip requirements, its code as the working_dir (a local zip that Ray's Jobs client uploads as a
        package, once per content, for every node to unpack), and PYTHONPATH ending in RINGMASTER_CODE_PATH."""
        own = spec.runtime_env
        env_vars = dict(own.env_vars) if own else {}
        # Ray puts the working_dir before all of these; the spec's own PYTHONPATH comes before the cluster's code path.
        python_path = os.pathsep.join(path for path in (env_vars.get("PYTHONPATH"), self.settings.code_path) if path)
        if python_path:
            env_vars["PYTHONPATH"] = python_path
        runtime_env: dict[str, Any] = {"env_vars": env_vars}
        if own and own.pip:
            runtime_env["pip"] = list(own.pip)
        if spec.code:
            runtime_env["working_dir"] = str(self._code_zip(session, tenant, spec.code))
        return runtime_env

    def _code_zip(self, session: Session, tenant: str, code: str) -> Path:
        """The local zip of a tenant's code archive, written (and its hash checked) once per process."""
        path = self._code_zips.get((tenant, code))
        if path is None or not path.exists():
            path = self._code_zips[(tenant, code)] = code_store.local_copy(
                session, tenant, code, self.settings.code_cache_dir()
            )
        return path

    def _fail(self, job_id: str, submission_id: str, message: str) -> None:
        """End the job FAILED now, not retried: what failed would fail the same way in every attempt."""
        with self.sessions() as session, session.begin():
            current = session.get(Job, job_id, with_for_update=True, populate_existing=True)
            if current is None or current.state not in ACTIVE or current.submission_id != submission_id:
                return  # the driver's report, a cancel, or another replica got there first
            current.lease_owner = current.lease_expires_at = None
            jobs.transition(session, current, JobState.FAILED, message)
            telemetry.record_reconciler_action(session, "failed_unstarted")
        log.warning(
            "job %s failed: %s",
            job_id,
            message.splitlines()[0],
            extra={"job_id": job_id, "submission_id": submission_id},
        )

    def _entrypoint(self, job: Job, attempt: int, group_name: str) -> str:
        """Short and readable, as the dashboard shows it: the spec travels in the attempt's DriverHandoff."""
        return (
            f"{self.settings.driver_python} -m ringmaster.workers.driver --job-id {job.id} --attempt {attempt} "
            f"--tenant {job.tenant} "
            + (f"--ray-address {self.cluster.gcs_address} " if self.cluster.gcs_address else "")
            + f"--placement-group {group_name} --api-url {self.settings.resolved_api_url()} "
            f"--storage-uri {self.settings.resolved_storage_uri()}"
        )

    def _metadata(self, job: Job, attempt: int, spec: JobSpec, world_size: int) -> dict[str, str]:
        """The Ray job's metadata: what the dashboard's job list and page show of it (`job_name` is its Name column)."""
        return {
            "job_name": f"{job.name} ({job.id[:8]}, attempt {attempt})",
            "ringmaster_job_id": job.id,
            "name": job.name,
            "tenant": job.tenant,
            "attempt": str(attempt),
            "strategy": "script" if spec.is_script else spec.strategy,  # a script job splits its model itself
            "world_size": str(world_size),
            "ringmaster_url": f"{self.settings.resolved_api_url()}/ui/jobs/{job.id}",
        }

    # -- watching ----------------------------------------------------------------------------

    def watch_active_jobs(self) -> None:
        """Reconcile the database with Ray: an active job whose Ray job died or vanished outside the
        driver's control (driver killed, Ray head restarted) is resubmitted as a new attempt, which
        resumes from the latest committed checkpoint and counts against max_failures. A job whose
        Ray job is alive is adopted as it is: never started twice. Once adopted, Ray is asked about a job
        only while its driver is quiet: a report in the last few seconds shows the driver alive."""
        current_attempt = (Attempt.job_id == Job.id) & (Attempt.number == Job.attempt)
        with self.sessions() as session:
            active = session.execute(
                select(Job, Attempt.last_report_at)
                .outerjoin(Attempt, current_attempt)
                .where(Job.state.in_([s.value for s in ACTIVE]))
            ).all()
        for job, last_report_at in active:
            try:
                self._reconcile(job, last_report_at)
            except ClusterUnreachable as error:
                log.warning("job %s not reconciled, retried: %s", job.id, error, extra={"job_id": job.id})
            except Exception:
                log.exception("reconciling job %s failed", job.id, extra={"job_id": job.id})

    def _reconcile(self, job: Job, last_report_at: datetime | None) -> None:
        if job.submission_id is None:
            return
        if (
            job.submission_id in self._seen_alive
            and last_report_at is not None
            and (utcnow() - last_report_at).total_seconds() < _REPORTING_DRIVER_ALIVE_S
        ):
            return  # its driver just reported: alive, and Ray need not be asked (a dashboard call per job per pass)
        context = {"job_id": job.id, "attempt": job.attempt, "submission_id": job.submission_id}
        ray_status = self.cluster.status(job.submission_id)
        if ray_status is not None and ray_status not in _RAY_TERMINAL:
            if job.submission_id not in self._seen_alive:
                self._seen_alive.add(job.submission_id)
                with self.sessions() as session, session.begin():
                    telemetry.record_reconciler_action(session, "adopted")
                log.info(
                    "job %s attempt %d: Ray job %s is %s; adopted, watching it",
                    job.id,
                    job.attempt,
                    job.submission_id,
                    ray_status,
                    extra=context,
                )
            return
        if (
            ray_status is None
            and job.state == JobState.ADMITTED
            and job.admitted_at
            and (utcnow() - job.admitted_at).total_seconds() < _SUBMIT_GRACE_S
        ):
            return  # another replica may be between recording the attempt and submitting it
        if (
            ray_status == "FAILED"
            and last_report_at is None
            and (never_started := self.cluster.start_failure(job.submission_id)) is not None
        ):
            self._fail(
                job.id, job.submission_id, f"attempt {job.attempt}: the job's driver never started: {never_started}"
            )
            return
        found = "is gone from Ray" if ray_status is None else f"ended {ray_status} without the driver reporting"
        message = f"attempt {job.attempt}: Ray job {job.submission_id} {found}; resubmitting"
        tail = self._log_tail(
            job.submission_id
        )  # fetched before locking: never hold the row (SQLite: the database) across a Ray call
        with self.sessions() as session, session.begin():
            current = session.get(Job, job.id, with_for_update=True, populate_existing=True)
            if current is None or current.state not in ACTIVE or current.submission_id != job.submission_id:
                return  # the driver's report, or another replica, got there first
            requeued = jobs.requeue(session, current, f"{message}\n{tail}" if tail else message, failure=True)
            telemetry.record_reconciler_action(session, "resubmitted")
        log.warning("job %s %s (now %s)", job.id, message, requeued.state, extra=context)

    def _log_tail(self, submission_id: str) -> str:
        try:
            return self.cluster.logs(submission_id)[-_LOG_TAIL:]
        except Exception:
            return ""

    def close_finished_attempts(self) -> None:
        """Stop the Ray job and free the placement group of every attempt whose job has moved on.

        A cancelled job is stopped at once; a job its driver reported finished gets a short grace
        to exit on its own, so its Ray job ends SUCCEEDED rather than STOPPED in the dashboard.
        """
        with self.sessions() as session:
            attempts = jobs.attempts_to_close(session)
            owners = {
                job.id: job for job in session.scalars(select(Job).where(Job.id.in_({a.job_id for a in attempts})))
            }
        # Replicas see the same list: each walks it in its own order, so they rarely close the same attempt at once.
        random.shuffle(attempts)
        for attempt in attempts:
            try:
                self._close(attempt, owners[attempt.job_id])
            except ClusterUnreachable as error:
                log.warning(
                    "attempt %d of job %s not closed yet, retried: %s",
                    attempt.number,
                    attempt.job_id,
                    error,
                    extra={"job_id": attempt.job_id},
                )
            except Exception:
                log.exception(
                    "closing attempt %d of job %s failed",
                    attempt.number,
                    attempt.job_id,
                    extra={"job_id": attempt.job_id},
                )

    def _close(self, attempt: Attempt, job: Job) -> None:
        with self.sessions() as session:
            if session.scalar(select(Attempt.ended_at).where(Attempt.id == attempt.id)) is not None:
                return  # another replica closed it since the list was read
        reported_end = (
            job.state in (JobState.SUCCEEDED, JobState.FAILED, JobState.PREEMPTED) and job.attempt == attempt.number
        )
        exit_grace_s = (
            _DRIVER_EXIT_GRACE_S
            if reported_end
            else _script_stop_grace_s(job, attempt, self.settings.resolved_storage_uri())
        )
        if (
            exit_grace_s
            and self.cluster.status(attempt.submission_id) not in _RAY_TERMINAL | {None}
            and job.finished_at
            and (utcnow() - job.finished_at).total_seconds() < exit_grace_s
        ):
            return
        self.cluster.stop(attempt.submission_id)
        if attempt.placement_group:
            self.cluster.release(attempt.placement_group)
        with self.sessions() as session, session.begin():
            closed = jobs.close_attempt(session, attempt, outcome=str(job.state))
            telemetry.record_reconciler_action(session, "attempt_closed")
            current = session.get(Job, job.id, populate_existing=True)
            if current is not None and current.state == JobState.PREEMPTED and current.attempt == attempt.number:
                jobs.queue_again(session, current)  # its room is free: it waits in its old place
        self._seen_alive.discard(attempt.submission_id)
        log.info(
            "job %s attempt %d closed (%s): Ray job %s stopped, placement group released",
            job.id,
            attempt.number,
            closed.outcome,
            attempt.submission_id,
            extra={"job_id": job.id, "attempt": attempt.number},
        )


def _script_stop_grace_s(job: Job, attempt: Attempt, storage_uri: str) -> float:
    """How long a cancelled script job's driver may take to end on its own: it sees the cancel in its next report's
    answer (within a second or two), then gives the script's processes stop_grace_s between SIGTERM and SIGKILL, so a
    script that saves on SIGTERM keeps its work, and on remote storage its workers upload that save. Stopping the Ray
    job, or releasing its bundles, would kill them at once. 0 for every other attempt."""
    if job.state != JobState.CANCELLED or job.attempt != attempt.number or not job.spec.get("command"):
        return 0.0
    upload_s = SCRIPT_FINAL_UPLOAD_WAIT_S if urlsplit(storage_uri).scheme not in ("", "file") else 0.0
    return float(JobSpec.model_validate(job.spec).stop_grace_s) + upload_s + _SCRIPT_STOP_MARGIN_S


def _capped(spec: JobSpec, max_workers: int) -> JobSpec:
    """The spec the driver runs: workers.max lowered to the quota's grant, so it never grows past it."""
    if max_workers >= spec.workers.max:
        return spec
    return spec.model_copy(update={"workers": spec.workers.model_copy(update={"max": max_workers})})
