"""The driver's controller for a script job (JobSpec.command): the team's own script, run as torchrun runs it.

Explicit states, one transition per iteration, as the managed controller (controller.py) has, over the same worker
group, bundles and scaling policy; its decisions are the scaling policy's (at what size to run) and the script
outcome policy's (script_policy.py: go on, succeeded, restart, fail).

ScriptPlacing ──(workers started, ranked, processes started)──▶ ScriptRunning ──(every rank exited 0)──▶ Finished
ScriptRunning ──(workers lost)──▶ ScriptRestarting ──(every process stopped, RECOVERING counted)──▶ ScriptPlacing
ScriptRunning ──(a rank exited non-zero, could not start)──▶ Failed (the other ranks stopped first)
ScriptPlacing ──(fewer than workers.min placeable for too long)──▶ Failed
any ──(the control plane ended the attempt: cancelled)──▶ Finished (every process stopped with stop_grace_s)
ScriptRunning ──(preempted)──▶ Finished (every process stopped with stop_grace_s, PREEMPTED reported)

Unlike the managed group, a script's group never changes size while it runs: torchrun's elastic semantics restart
every process of the group at the size the scaling policy decides, with TORCHELASTIC_RESTART_COUNT one higher, and
the script resumes from its own checkpoint in RINGMASTER_CHECKPOINT_DIR.
"""

from __future__ import annotations

import logging
import shlex
import sys
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ValidationError
from ray.exceptions import RayActorError, RayTaskError

from ringmaster.service.naming import TENSORBOARD_DIR
from ringmaster.service.reports import MetricPoint
from ringmaster.service.spec import JobSpec
from ringmaster.workers.driver.collaborators import JobBundles
from ringmaster.workers.driver.policies import FormGroup, GiveUp, ScalingPolicy
from ringmaster.workers.driver.ray_facade import Clock, RayFacade
from ringmaster.workers.driver.script_policy import (
    AllSucceeded,
    FailScript,
    KeepRunning,
    RankExit,
    RestartGroup,
    ScriptOutcomePolicy,
)
from ringmaster.workers.driver.states import Failed, Finished
from ringmaster.workers.driver.training_log import TrainingLog
from ringmaster.workers.driver.worker_group import RankedWorker, WorkerGroup
from ringmaster.workers.reporter import Reporter
from ringmaster.workers.script.checkpoint_sync import FINAL_UPLOAD_WAIT_S
from ringmaster.workers.script.environment import (
    RankPlace,
    ScriptPaths,
    environment_for_ranks,
    omp_num_threads_given,
    resolved_command,
    script_paths,
)

log = logging.getLogger("ringmaster.driver")

POLL_INTERVAL_S = 0.5  # a look at every worker: output lines, exits, metric points
POLL_TIMEOUT_S = 3.0  # a worker that has not answered a poll this long is probed
PROBE_TIMEOUT_S = 2.0  # see controller.py
PROBE_GRACE_S = 0.25
KEEPALIVE_S = 1.0  # a report at least this often: its answer says whether the job was cancelled
START_TIMEOUT_S = 120.0
CAPACITY_WAIT_S = 60.0
CAPACITY_LOOK_S = 1.0
STOP_MARGIN_S = 10.0  # past stop_grace_s, for the SIGKILL to land and the answer to come back
RECOVERY_ACK_WAIT_S = 5.0  # the control plane's answer to RECOVERING: whether max_failures allows the restart
_MAX_MESSAGE = 20_000


@dataclass
class ScriptPlacing:
    """(Re)starting the group: survivors in hand, new workers to start where bundles can be placed."""

    restart_count: int
    waiting_since: float
    reason: str = "starting"


@dataclass
class ScriptRunning:
    restart_count: int
    exits: dict[int, RankExit] = field(default_factory=dict)  # the ranks whose process ended, by rank


@dataclass(frozen=True)
class ScriptRestarting:
    lost: list[RankedWorker]
    reason: str
    restart_count: int


ScriptState = ScriptPlacing | ScriptRunning | ScriptRestarting | Finished | Failed


@dataclass
class ScriptController:
    spec: JobSpec
    job_id: str
    attempt: int
    storage_uri: str
    reporter: Reporter
    group: WorkerGroup
    bundles: JobBundles
    ray: RayFacade
    clock: Clock
    tenant: str = "default"

    def __post_init__(self) -> None:
        assert self.spec.command is not None, "a script job has a command"
        self.command = resolved_command(self.spec.command, sys.executable)
        storage_root = f"{self.storage_uri.rstrip('/')}/{self.job_id}"
        tensorboard_dir = f"{storage_root}/{TENSORBOARD_DIR}/attempt-{self.attempt}"
        self.paths: ScriptPaths = script_paths(storage_root, tensorboard_dir, self.job_id)
        self.scaling = ScalingPolicy(self.spec.workers, CAPACITY_WAIT_S)
        self.outcomes = ScriptOutcomePolicy()
        self.training_log = TrainingLog(
            self.spec, self.job_id, self.attempt, self.tenant, tensorboard_dir=tensorboard_dir
        )
        self._reported_at = 0.0
        own_env = self.spec.runtime_env.env_vars if self.spec.runtime_env else {}
        self._omp_given = omp_num_threads_given(own_env)

    def run(self) -> int:
        """Drive the job to an end; 0 when it succeeded or the control plane ended the attempt, 1 when it failed."""
        if self.paths.checkpoint_uri is not None:
            log.info(
                "storage %s is remote: RINGMASTER_CHECKPOINT_DIR is %s on each node, filled from %s before each start "
                "and uploaded there while the script runs and after it ends (docs/jobs/script-mode.md)",
                self.storage_uri,
                self.paths.checkpoint_dir,
                self.paths.checkpoint_uri,
            )
        state: ScriptState = ScriptPlacing(restart_count=self.attempt - 1, waiting_since=self.clock.monotonic())
        try:
            while not isinstance(state, (Finished, Failed)):
                state = self.step(state)
        except Exception:
            state = Failed(f"driver error:\n{traceback.format_exc()}")
        finally:
            if isinstance(state, Failed):
                self._report(state="FAILED", message=state.reason[-_MAX_MESSAGE:])
            self.training_log.close()
            self.group.shutdown()
            self.bundles.release()
        return 1 if isinstance(state, Failed) else 0

    def step(self, state: ScriptState) -> ScriptState:
        """One transition."""
        if isinstance(state, ScriptPlacing):
            return self._place(state)
        if isinstance(state, ScriptRunning):
            return self._run(state)
        if isinstance(state, ScriptRestarting):
            return self._restart(state)
        raise AssertionError(f"no transition from {state}")

    # -- placing and starting ---------------------------------------------------------------------

    def _place(self, placing: ScriptPlacing) -> ScriptState:
        """Start workers on the free bundles that can be placed now, and start the script on the size the scaling
        policy decides; else wait for capacity (a state of its own each time) or give up."""
        if self.reporter.ended.is_set():
            log.info("the control plane ended this attempt (job %s) before it started", self.reporter.ended_state)
            return Finished(succeeded=False)
        survivors = self.group.workers
        wanted = self.spec.workers.max - len(survivors)
        slots = self.bundles.spare({worker.slot for worker in survivors})[:wanted] if wanted else []
        added = self.group.launch(slots, START_TIMEOUT_S) if slots else []
        members = survivors + added
        decision = self.scaling.decide(len(members), self.clock.monotonic() - placing.waiting_since, placing.reason)
        if isinstance(decision, GiveUp):
            return Failed(decision.reason)
        if not isinstance(decision, FormGroup):
            for worker in added:
                self.ray.kill(worker.actor)
            self._keep_alive()  # its answer says whether the job was cancelled meanwhile
            self.clock.sleep(CAPACITY_LOOK_S)
            return placing
        for extra in members[decision.size :]:
            self.ray.kill(extra.actor)
        self.group.rank(members[: decision.size])
        return self._start_processes(placing.restart_count)

    def _start_processes(self, restart_count: int) -> ScriptState:
        """Start the command on every rank of the group, with torchrun's environment."""
        workers = self.group.workers
        master = workers[0]
        port = self.ray.get(master.actor.free_port.remote())
        environments = environment_for_ranks(
            [RankPlace(worker.node_id, worker.gpu_ids) for worker in workers],
            master_addr=master.ip,
            master_port=port,
            run_id=self.job_id,
            restart_count=restart_count,
            max_restarts=self.spec.max_failures,
            paths=self.paths,
            omp_num_threads_given=self._omp_given,
        )
        paths = asdict(self.paths)
        if self.paths.checkpoint_uri is not None:
            unfilled = self._fill_checkpoint_dirs(workers, paths)
            if unfilled is not None:
                return unfilled
        pids = self.ray.get(
            [
                worker.actor.start.remote(self.command, variables, paths, worker.rank)
                for worker, variables in zip(workers, environments, strict=True)
            ]
        )
        for worker, pid in zip(workers, pids, strict=True):
            worker.training_pid = pid
            log.info(
                "rank %d: pid %d on node %s (worker actor %s, %s)",
                worker.rank,
                pid,
                worker.node_id[:12],
                worker.actor_id,
                worker.name,
            )
        what = shlex.join(self.spec.command or [])
        details = {
            "world_size": self.group.world_size,
            "restart_count": restart_count,
            "master": f"{master.ip}:{port}",
            "checkpoint_dir": self.paths.checkpoint_dir,
            "ranks": [worker.describe() for worker in workers],
        }
        restarted = f" (restart {restart_count})" if restart_count else ""
        self._report(
            state="RUNNING",
            message=f"running `{what}` on {self.group.world_size} worker(s) across {len(self.group.nodes)} node(s)"
            f"{restarted}",
            details=details,
        )
        return ScriptRunning(restart_count)

    def _fill_checkpoint_dirs(self, workers: list[RankedWorker], paths: dict[str, Any]) -> Failed | None:
        """On remote storage: every node's RINGMASTER_CHECKPOINT_DIR made a copy of the storage's before any rank
        starts (a node's workers take turns: the first downloads, the others find it done). A storage that cannot be
        read fails the job: a script that started from nothing would upload over the checkpoints it could not see."""
        filled = self.ray.get([worker.actor.fill_checkpoint_dir.remote(paths) for worker in workers])
        for worker, done in zip(workers, filled, strict=True):
            if done["error"] is not None:
                return Failed(
                    f"RINGMASTER_CHECKPOINT_DIR could not be filled from {self.paths.checkpoint_uri} on node "
                    f"{worker.node_id[:12]} (rank {worker.rank}): {done['error']}"
                )
            if done["files"] or done["removed"]:
                log.info(
                    "rank %d (node %s): RINGMASTER_CHECKPOINT_DIR filled from %s: %d file(s), %d bytes downloaded, "
                    "%d removed, in %.1f s",
                    worker.rank,
                    worker.node_id[:12],
                    self.paths.checkpoint_uri,
                    done["files"],
                    done["bytes"],
                    done["removed"],
                    done["seconds"],
                )
        return None

    # -- running ----------------------------------------------------------------------------------

    def _run(self, running: ScriptRunning) -> ScriptState:
        if self.reporter.ended.is_set():
            log.info("the control plane ended this attempt (job %s): stopping the script", self.reporter.ended_state)
            self._stop_all(self.spec.stop_grace_s)
            return Finished(succeeded=False)
        if self.reporter.preempting.is_set():
            # As torchrun's scripts are stopped: SIGTERM, stop_grace_s to save, then SIGKILL; the job is queued again
            # and its script resumes from what it saved in RINGMASTER_CHECKPOINT_DIR.
            self._stop_all(self.spec.stop_grace_s)
            for_job = self.reporter.preempted_for
            self._report(
                state="PREEMPTED",
                message="the script was stopped (SIGTERM, then "
                f"{self.spec.stop_grace_s:g} s to save), "
                + (f"preempted for job {for_job}" if for_job else "moving off a draining node"),
                details={"preempted_for": for_job, "restart_count": running.restart_count},
            )
            return Finished(succeeded=False)
        lost = self._poll(running)
        if not lost and any(ended.code != 0 and not ended.stopped for ended in running.exits.values()):
            # A rank that failed because a peer's node died looks like a failed script until the loss is known.
            lost = self.group.unresponsive(PROBE_TIMEOUT_S, PROBE_GRACE_S)
        decision = self.outcomes.decide(self.group.world_size, lost, running.exits)
        if isinstance(decision, RestartGroup):
            return ScriptRestarting(lost, decision.reason, running.restart_count)
        if isinstance(decision, FailScript):
            self._stop_all(self.spec.stop_grace_s)
            return Failed(decision.reason)
        if isinstance(decision, AllSucceeded):
            self._report(
                state="SUCCEEDED",
                message=f"the script exited 0 on all {self.group.world_size} rank(s)",
                details={"world_size": self.group.world_size, "restart_count": running.restart_count},
            )
            return Finished(succeeded=True)
        assert isinstance(decision, KeepRunning)
        self._keep_alive()
        self.clock.sleep(POLL_INTERVAL_S)
        return running

    def _keep_alive(self) -> None:
        """An empty report when nothing else was reported for a while: its answer says whether the job was cancelled
        (Reporter.ended), and it shows the reconciler the driver alive."""
        if self.clock.monotonic() - self._reported_at >= KEEPALIVE_S:
            self._report()

    def _poll(self, running: ScriptRunning) -> list[RankedWorker]:
        """Print every rank's new output, prefixed with its rank, forward rank 0's metric points, note the exits;
        returns the workers that did not answer (dead, or their node frozen)."""
        polls = {worker.actor.poll.remote(): worker for worker in self.group.workers}
        ready, not_ready = self.ray.wait(list(polls), len(polls), POLL_TIMEOUT_S)
        lost = [polls[ref] for ref in not_ready]
        for ref in ready:
            worker = polls[ref]
            try:
                polled = self.ray.get(ref)
            except (RayActorError, RayTaskError):
                lost.append(worker)
                continue
            self._print(worker.rank, polled["lines"], polled["dropped"])
            self._forward(polled["metrics"])
            self._notes(worker, polled.get("notes", []))
            if polled["exit"] is not None and worker.rank not in running.exits:
                running.exits[worker.rank] = RankExit.of(
                    worker.rank, worker.node_id, worker.training_pid, polled["exit"], polled["stderr_tail"]
                )
        if lost and len(lost) < len(polls):
            # A slow answer is not a death: only those that fail a heartbeat as well are lost.
            lost = self.group.unresponsive(PROBE_TIMEOUT_S, PROBE_GRACE_S, lost)
        return sorted(lost, key=lambda worker: worker.rank)

    def _print(self, rank: int, lines: list[tuple[str, str]], dropped: int) -> None:
        """The rank's lines in the driver's log (the Ray job's, which `ringmaster logs` and the web view show)."""
        if dropped:
            print(f"[rank {rank}] … {dropped} line(s) of output dropped: more than the driver could keep up with")
        for stream, text in lines:
            print(f"[rank {rank}] {text}", file=sys.stderr if stream == "stderr" else sys.stdout)
        if lines:
            sys.stdout.flush()
            sys.stderr.flush()

    def _notes(self, worker: RankedWorker, notes: list[tuple[int, str]]) -> None:
        """A worker's checkpoint sync notes: in the driver's log, and a failure among the job's events as well."""
        for level, text in notes:
            line = f"rank {worker.rank} (node {worker.node_id[:12]}): {text}"
            log.log(level, line)
            if level >= logging.WARNING:
                self._report(message=line)

    def _forward(self, points: list[dict[str, Any]]) -> None:
        """Rank 0's metric points to the control plane; one the control plane would refuse is said in the log."""
        forwarded = []
        for point in points:
            try:
                forwarded.append(MetricPoint(**point, world_size=self.group.world_size))
            except ValidationError as error:
                log.warning("a metric point of the script left out (step %s): %s", point.get("step"), error)
        if forwarded:
            self._report(metrics=forwarded)

    # -- restarting and stopping ------------------------------------------------------------------

    def _restart(self, restarting: ScriptRestarting) -> ScriptState:
        """Stop every process of the group, leave the lost workers out, and count the restart with the control plane
        (which ends the attempt past max_failures) before placing the next run."""
        survivors = [worker for worker in self.group.workers if worker not in restarting.lost]
        self._stop_all(self.spec.stop_grace_s, survivors)
        # A worker whose process alone died (its node lives) leaves a bundle a new worker can take at once.
        self.bundles.lost_nodes |= {
            worker.node_id for worker in restarting.lost if not self.ray.died_on_a_live_node(worker.actor_id)
        }
        before = self.group.world_size
        seq = self._report(
            state="RECOVERING",
            message=f"{restarting.reason}; restarting every process of the group",
            details={
                "lost_ranks": sorted(worker.rank for worker in restarting.lost),
                "lost_nodes": sorted({worker.node_id for worker in restarting.lost}),
                "world_size_before": before,
                "restart_count": restarting.restart_count + 1,
            },
        )
        self.group.remove(restarting.lost)
        deadline = self.clock.monotonic() + RECOVERY_ACK_WAIT_S
        while self.reporter.handled_seq < seq and self.clock.monotonic() < deadline:
            self.clock.sleep(0.05)
        if self.reporter.ended.is_set():
            log.info("the control plane ended this attempt (job %s): no restart", self.reporter.ended_state)
            return Finished(succeeded=False)
        return ScriptPlacing(
            restart_count=restarting.restart_count + 1,
            waiting_since=self.clock.monotonic(),
            reason=restarting.reason,
        )

    def _stop_all(self, grace_s: float, workers: list[RankedWorker] | None = None) -> None:
        """SIGTERM to every rank's process, SIGKILL to those still there after `grace_s`; their last output is
        printed."""
        workers = self.group.workers if workers is None else workers
        stops = [worker.actor.stop.remote(grace_s) for worker in workers]
        # On remote storage a worker answers once its final upload is done (or FINAL_UPLOAD_WAIT_S has passed).
        upload_s = FINAL_UPLOAD_WAIT_S if self.paths.checkpoint_uri is not None else 0.0
        self.ray.wait(stops, len(stops), grace_s + STOP_MARGIN_S + upload_s)
        polls = {worker.actor.poll.remote(): worker for worker in workers}
        ready, _ = self.ray.wait(list(polls), len(polls), POLL_TIMEOUT_S)
        for ref in ready:
            try:
                polled = self.ray.get(ref)
            except (RayActorError, RayTaskError):
                continue
            self._print(polls[ref].rank, polled["lines"], polled["dropped"])
            self._forward(polled["metrics"])
            self._notes(polls[ref], polled.get("notes", []))

    def _report(
        self,
        *,
        state: str | None = None,
        message: str | None = None,
        metrics: list[MetricPoint] | None = None,
        details: dict[str, Any] | None = None,
    ) -> int:
        """Report to the control plane, and say it in the driver's log."""
        if metrics:
            self.training_log.metrics(metrics, self.group.world_size)
        if message:
            self.training_log.event(message, state)
        self._reported_at = self.clock.monotonic()
        return self.reporter.report(state=state, message=message, metrics=metrics, details=details)
