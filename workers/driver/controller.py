"""The job driver's controller: explicit states (states.py), one transition per loop iteration, decisions taken by
policies (policies.py).

Starting launches a worker on each admitted bundle and forms the group. Running polls the training call (one poll
per iteration: calls returned, workers lost, progress drained) and forwards progress; it keeps warm workers beside the
group and asks it to stop at the next step once it can grow. Recovering (after a loss) and Resizing (after a stop to
grow) keep the survivors and take standbys; Placing starts new workers where bundles can be placed, as the scaling
policy says, and forms the next generation at the size it decides, which resumes from the newest snapshot in the
members' memory, else from the latest committed checkpoint. The controller talks to the control plane only through
the reporter.

What it drives is handed to it (collaborators.py): the worker group, the attempt's bundles, the standby pool, the
training call's poll, the few Ray calls it makes itself and the clock it waits on (ray_facade.py). The job's
entrypoint (__main__.py) hands it the live ones; tests/workers/driver/test_controller.py takes every transition against
fakes, in-process.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError

from ringmaster.service.naming import TENSORBOARD_DIR
from ringmaster.service.reports import CheckpointRecord, MetricPoint, RankMemory
from ringmaster.service.spec import JobSpec
from ringmaster.workers.checkpoint.snapshots.resume_choice import choose_snapshot
from ringmaster.workers.driver.bundles import Slot
from ringmaster.workers.driver.collaborators import Group, JobBundles, Standbys, StartPoll, TrainingPoll
from ringmaster.workers.driver.policies import FailJob, FailurePolicy, FormGroup, GiveUp, ScalingPolicy
from ringmaster.workers.driver.poll import GroupPoll, PollResult
from ringmaster.workers.driver.ray_facade import Clock, RayFacade
from ringmaster.workers.driver.states import (
    Failed,
    Finished,
    Placing,
    Recovering,
    Resizing,
    Running,
    Starting,
    State,
)
from ringmaster.workers.driver.training_log import TrainingLog
from ringmaster.workers.driver.worker_group import RankedWorker
from ringmaster.workers.metric_ledger import DrainedMetrics
from ringmaster.workers.reporter import Reporter

log = logging.getLogger("ringmaster.driver")

# The longest the driver sleeps between looks at the group (a training call that ends wakes it at once).
POLL_INTERVAL_S = 0.5
# Rank 0's metrics are fetched, and reported, this often: each fetch takes the GIL from its training thread, and
# each report is a database transaction, both on CPUs that training may share.
DRAIN_INTERVAL_S = 1.0
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 3.0  # a frozen node is declared lost within this (plus one interval)
PROBE_TIMEOUT_S = 2.0  # after a failed collective: who is still there?
# ... and who has not answered this long after another worker did. A live worker's heartbeat answers within 15 ms of
# its peers' even while both train on saturated CPUs (bench/probe_latency.py); a dead one's hangs until Ray declares
# its node dead, so every millisecond of this grace is added to the recovery from a node's death.
PROBE_GRACE_S = 0.25
COLLECTIVE_TIMEOUT_S = 60.0  # backstop; failures are normally noticed by the driver long before
# A member lost while the group forms keeps the others waiting this long; the driver's next formation waits for them.
# Members reach the rendezvous within seconds of each other (each once its training stack is imported).
RENDEZVOUS_TIMEOUT_S = 30.0
START_TIMEOUT_S = 120.0  # first start: worker processes import torch
REPLACEMENT_WAIT_S = 5.0  # below workers.min with spare capacity: wait this long for Ray to move the lost bundles
REPLACEMENT_POLL_S = 0.05  # ... looking this often: each look is two GCS queries, each missed moment a recovery's delay
CAPACITY_WAIT_S = 60.0  # fewer than workers.min placeable: wait this long before giving up
CAPACITY_LOOK_S = 1.0  # ... looking again this often (each look a Placing of its own)
# A live standby answers at once and a dead one fails at once; only a loaded machine handling a node's death needs more.
STANDBY_PROBE_TIMEOUT_S = 10.0
_MAX_MESSAGE = 20_000


def poll_training(group: Group, futures: dict[Any, RankedWorker]) -> TrainingPoll:
    """The live poll of a training call (poll.py), at the driver's intervals."""
    return GroupPoll(
        group,
        futures,
        interval_s=POLL_INTERVAL_S,
        drain_every_s=DRAIN_INTERVAL_S,
        heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        probe_timeout_s=PROBE_TIMEOUT_S,
        probe_grace_s=PROBE_GRACE_S,
    )


@dataclass(frozen=True)
class GroupAndWarmCounts:
    """How many workers the group has, and how many warm workers beside it are ready or starting: what the scaling
    policy decides from (policies.GroupCounts)."""

    world_size: int
    warm_ready: int
    warm_starting: int


@dataclass
class Controller:
    spec: JobSpec
    job_id: str
    attempt: int
    storage_uri: str
    reporter: Reporter
    group: Group
    bundles: JobBundles
    standby: Standbys
    ray: RayFacade
    clock: Clock
    tenant: str = "default"
    start_poll: StartPoll = poll_training
    state: State = field(default_factory=Starting)

    def __post_init__(self) -> None:
        self.storage_root = f"{self.storage_uri.rstrip('/')}/{self.job_id}"
        # JobSpec.resume_from: the other job's storage, resumed from while this job has no checkpoint of its own.
        self.resume_from_root = (
            f"{self.storage_uri.rstrip('/')}/{self.spec.resume_from}" if self.spec.resume_from else None
        )
        self.failures = FailurePolicy()
        self.scaling = ScalingPolicy(self.spec.workers, CAPACITY_WAIT_S)
        self._rank0_metrics = DrainedMetrics()
        self._poll: TrainingPoll | None = None  # the latest training call's
        self.training_log = TrainingLog(
            self.spec,
            self.job_id,
            self.attempt,
            self.tenant,
            tensorboard_dir=f"{self.storage_root}/{TENSORBOARD_DIR}/attempt-{self.attempt}",
        )

    def run(self) -> int:
        """Drive the job to an end; 0 when it succeeded or the control plane ended the attempt, 1 when it failed
        (reported either way)."""
        try:
            while not isinstance(self.state, (Finished, Failed)):
                self.state = self.step(self.state)
        except Exception:
            self.state = Failed(f"driver error:\n{traceback.format_exc()}")
        finally:
            if isinstance(self.state, Failed):
                self._report_failure(self.state.reason)
            self.training_log.close()
            self.group.shutdown()
            self.standby.shutdown()
            self.bundles.release()
        return 1 if isinstance(self.state, Failed) else 0

    def step(self, state: State) -> State:
        """One transition."""
        if isinstance(state, Starting):
            return self._start()
        if isinstance(state, Running):
            return self._run(state)
        if self.reporter.preempting.is_set():
            # Not training now (starting, re-forming): nothing newer than the latest checkpoint to save.
            self._report(
                state="PREEMPTED", message="stopped while the group formed; resumes from its latest checkpoint"
            )
            return Finished(succeeded=False)
        if isinstance(state, (Recovering, Resizing)):
            return self._regroup(state)
        if isinstance(state, Placing):
            return self._place(state)
        raise AssertionError(f"no transition from {state}")

    # -- starting and running ---------------------------------------------------------------------

    def _start(self) -> State:
        # Reserve standby capacity first (it does not wait): standbys start while the group forms.
        self.standby.top_up(self.spec.workers.standby, taken=set(self.bundles.admission))
        began = self.clock.monotonic()
        members = self.group.launch(self.bundles.admission, START_TIMEOUT_S)
        log.info(
            "%d worker actor(s) running after %.2fs (%d from the warm pool)",
            len(members),
            self.clock.monotonic() - began,
            self.group.pooled_started,
        )
        formation = self.scaling.formation(len(members))
        if formation is None:
            return Failed(f"only {len(members)} of {self.spec.workers.min} workers started")
        if (lost := self._form_without_the_lost(members, formation, world_size_before_forming=0)) is not None:
            return lost  # re-formed as after a loss, which reports RUNNING once formed
        log.info("process group formed after %.2fs", self.clock.monotonic() - began)
        self._report(
            state="RUNNING",
            message=f"training on {self.group.world_size} workers across {len(self.group.nodes)} node(s)",
            details={
                "world_size": self.group.world_size,
                "warm_pool_workers": self.group.pooled_started,
                "ranks": [worker.describe() for worker in self.group.workers],
            },
        )
        return self._train()

    def _train(self, resume_snapshot: dict[str, int] | None = None) -> Running:
        """Start the group's training call: it resumes from the in-memory snapshot `resume_snapshot` names, else from
        the latest committed checkpoint."""
        self._rank0_metrics.restart()
        futures = self.group.train(self.job_id, self.storage_root, self.resume_from_root, self.attempt, resume_snapshot)
        self._poll = self.start_poll(self.group, futures)
        return Running(self._poll)

    def _run(self, running: Running) -> State:
        if self.reporter.ended.is_set():
            log.info("the control plane ended this attempt (job %s): stopping", self.reporter.ended_state)
            return Finished(succeeded=False)  # cancelled, or superseded: run's finally frees the workers and bundles
        result = running.poll.poll(self._rank0_metrics.acknowledged(self.reporter.handled_seq))
        self._forward(result)
        if result.broken:
            running.poll.settle_interrupted(COLLECTIVE_TIMEOUT_S)
            decision = self.failures.decide(result.lost, result.errors)
            if isinstance(decision, FailJob):
                return Failed(decision.reason)
            return Recovering(result.lost, decision.reason)
        if result.finished is not None:
            stopped = [outcome for outcome in result.finished if outcome["stopped"]]
            if stopped and running.preempting:
                return self._preempted(stopped[0])
            if stopped:
                return Resizing()
            final = result.finished[0]
            self._report(
                state="SUCCEEDED", message=f"finished at step {final['step']}, checkpoint {final['checkpoint_uri']}"
            )
            return Finished(succeeded=True)
        if self.reporter.preempting.is_set() and not running.preempting:
            if not running.stopping:
                self.group.request_stop()  # every rank stops after this step and saves a durable checkpoint
            running.stopping = running.preempting = True
            return running
        self._keep_workers_warm()
        if not running.stopping and self.scaling.should_grow(self._group_and_warm()):
            self.group.request_stop()  # every rank stops after this step and checkpoints
            running.stopping = True
        return running

    def _preempted(self, stopped: dict[str, Any]) -> Finished:
        """The group saved at a step boundary for a preemption: say so, and end the attempt (the job is queued again
        and resumes from this checkpoint, no step redone)."""
        for_job = self.reporter.preempted_for
        self._report(
            state="PREEMPTED",
            message=f"saved at step {stopped['step']} ({stopped['checkpoint_uri']}) and stopped, "
            + (f"preempted for job {for_job}" if for_job else "moving off a draining node"),
            details={"step": stopped["step"], "checkpoint_uri": stopped["checkpoint_uri"], "preempted_for": for_job},
        )
        return Finished(succeeded=False)

    def _forward(self, result: PollResult) -> None:
        """Forward rank 0's metrics, checkpoints and events, and each rank's one memory report."""
        if not result.drained:
            return
        memory = [RankMemory(**measured) for _, batch in result.drained for measured in batch["memory"]]
        worker, first = result.drained[0]
        if worker.rank != 0:
            first = {"metrics": [], "checkpoints": [], "events": []}
        if first["metrics"] or first["checkpoints"] or memory:
            seq = self._report(
                metrics=[MetricPoint(**point) for point in first["metrics"]],
                checkpoints=[CheckpointRecord(**record) for record in first["checkpoints"]],
                memory=memory,
            )
            self._rank0_metrics.forwarded(seq, len(first["metrics"]))
        for event in first.get("events", []):
            self._report(message=event["message"], details=event["details"])

    def _keep_workers_warm(self) -> None:
        """Warm the workers the group would grow by, and the standbys the spec asks for."""
        missing = self.scaling.missing(self._group_and_warm())
        taken = {worker.slot for worker in self.group.workers}
        for ready in self.standby.top_up(self.scaling.warm_wanted(self._group_and_warm()), taken):
            if missing:
                self._report(
                    message=f"worker warm on node {ready.node_id[:12]}: the group grows to it at the next step",
                    details={"warm_node": ready.node_id, "warm_pid": ready.pid},
                )
            else:
                self._report(
                    message=f"standby worker ready on node {ready.node_id[:12]}",
                    details={"standby_node": ready.node_id, "standby_pid": ready.pid},
                )

    def _group_and_warm(self) -> GroupAndWarmCounts:
        return GroupAndWarmCounts(self.group.world_size, len(self.standby.ready), self.standby.starting)

    # -- re-forming ------------------------------------------------------------------------------

    def _regroup(self, state: Recovering | Resizing) -> State:
        """Keep the survivors and take the standbys it needs; Placing then adds new workers and forms the group."""
        recovering = state if isinstance(state, Recovering) else None
        now = self.clock.monotonic()
        placing = Placing(
            reason=recovering.reason if recovering is not None else "capacity returned",
            recovering=recovering is not None,
            world_size_before=(
                recovering.world_size_before_forming
                if recovering is not None and recovering.world_size_before_forming is not None
                else self.group.world_size
            ),
            started=now,
            waiting_since=now,
        )
        if recovering is not None:
            # A node's death reaches the driver one actor at a time: the others it took can still look alive. Asked
            # now, they fail a heartbeat at once (Ray knows the node is gone); live ones answer in milliseconds.
            lost_nodes = {worker.node_id for worker in recovering.lost}
            suspects = [
                worker
                for worker in self.group.workers
                if worker.node_id in lost_nodes and worker not in recovering.lost
            ]
            lost = recovering.lost + (
                self.group.unresponsive(PROBE_TIMEOUT_S, PROBE_GRACE_S, suspects) if suspects else []
            )
            # A worker whose process alone died (its node lives) leaves a bundle a replacement can take at once.
            self.bundles.lost_nodes |= {
                worker.node_id for worker in lost if not self.ray.died_on_a_live_node(worker.actor_id)
            }
            self._report(
                state=None if recovering.while_forming else "RECOVERING",
                message=f"{recovering.reason}; re-forming the group",
                details={
                    "lost_ranks": sorted(worker.rank for worker in lost),
                    "lost_nodes": sorted({worker.node_id for worker in lost}),
                    "lost_pids": sorted(worker.pid for worker in lost),
                    "world_size_before": placing.world_size_before,
                },
            )
            self.group.remove(lost)
        if self.scaling.wait_for_warming(self._group_and_warm()):
            self.standby.wait_for_starting(START_TIMEOUT_S)
        missing = self.scaling.missing(self._group_and_warm())
        placing.standbys = self.standby.take(missing, STANDBY_PROBE_TIMEOUT_S) if missing else []
        placing.wanted = self.scaling.new_workers_wanted(self.group.world_size, len(placing.standbys))
        taken = self._taken(placing)
        if placing.wanted and len(self.bundles.spare(taken)) < placing.wanted and self.bundles.spare_capacity():
            # Spare capacity exists: Ray moves the lost bundles onto it once it declares their node dead.
            deadline = self.clock.monotonic() + REPLACEMENT_WAIT_S
            while len(self.bundles.spare(taken)) < placing.wanted and self.clock.monotonic() < deadline:
                self.clock.sleep(REPLACEMENT_POLL_S)
        placing.waiting_since = self.clock.monotonic()
        return placing

    def _place(self, placing: Placing) -> State:
        """Start new workers where bundles can be placed now; form the next generation at the size the scaling
        policy decides, else wait (a state of its own each time) or give up."""
        spare = self.bundles.spare(self._taken(placing))[: placing.wanted]
        added = self.group.launch(spare, START_TIMEOUT_S) if placing.wanted else []
        members = self.group.workers + placing.standbys + added
        log.info(
            "regroup after %.1fs: %d survivor(s), %d of %d new worker(s) started",
            self.clock.monotonic() - placing.started,
            self.group.world_size,
            len(added),
            len(spare),
        )
        decision = self.scaling.decide(len(members), self.clock.monotonic() - placing.waiting_since, placing.reason)
        if not isinstance(decision, FormGroup):
            for worker in added:
                self.ray.kill(worker.actor)
            if self.reporter.ended.is_set():
                log.info(
                    "the control plane ended this attempt (job %s) while it waited for capacity",
                    self.reporter.ended_state,
                )
                return Finished(succeeded=False)
            if isinstance(decision, GiveUp):
                return Failed(decision.reason)
            self.clock.sleep(CAPACITY_LOOK_S)
            return placing
        before_forming = placing.world_size_before if placing.recovering else None
        if (lost := self._form_without_the_lost(members, decision, before_forming)) is not None:
            return lost
        log.info(
            "formed generation %d at %d workers after %.1fs",
            self.group.generation,
            self.group.world_size,
            self.clock.monotonic() - placing.started,
        )
        # The newest step the members hold in memory between them; else rank 0 names the checkpoint it will resume
        # from (reading checkpoints takes torch, which the driver never imports: 2-3 s of CPU, taken from training).
        snapshot = choose_snapshot(self.group.snapshot_inventories(self.job_id))
        if snapshot.chosen is not None:
            resumed, source = snapshot.chosen["step"], "memory"
        else:
            rank0 = self.group.workers[0].actor
            resumed = self.ray.get(rank0.resume_step.remote(self.storage_root, self.resume_from_root))
            source = "storage"
            if snapshot.why_not:
                self._report(
                    message=f"{snapshot.why_not}: resuming from the durable checkpoint of step {resumed}",
                    details={"memory_fallback": snapshot.why_not, "resumed_from_step": resumed},
                )
        before = placing.world_size_before
        details = {
            "world_size": self.group.world_size,
            "world_size_before": before,
            "resumed_from_step": resumed,
            "resumed_from": source,
            "ranks": [worker.describe() for worker in self.group.workers],
            "standby_workers_used": len(placing.standbys),
            "workers_missing": self.scaling.missing(self._group_and_warm()),
            "nodes": len(self.group.nodes),
            "regroup_s": round(self.clock.monotonic() - placing.started, 3),
        }
        where = "peers' memory" if source == "memory" else "durable checkpoint"
        message = f"re-formed at {self.group.world_size} workers (was {before}), resuming from step {resumed} ({where})"
        if placing.recovering:
            self._report(state="RUNNING", message=message, details=details)
        else:
            self._report(message=f"capacity returned: {message}", details=details)
        return self._train(snapshot.chosen)

    def _report(
        self,
        *,
        state: str | None = None,
        message: str | None = None,
        metrics: list[MetricPoint] | None = None,
        checkpoints: list[CheckpointRecord] | None = None,
        **rest: Any,
    ) -> int:
        """Report to the control plane, and say it in the driver's log (what the Ray dashboard shows of the job)."""
        if metrics:
            self.training_log.metrics(metrics, self.group.world_size)
        for record in checkpoints or []:
            self.training_log.checkpoint(record)
        if message:
            self.training_log.event(message, state)
        return self.reporter.report(state=state, message=message, metrics=metrics, checkpoints=checkpoints, **rest)

    def _taken(self, placing: Placing) -> set[Slot]:
        """Slots held by the survivors, the standbys taken to join them, and the standbys still warm."""
        return {worker.slot for worker in self.group.workers + placing.standbys} | set(self.standby.slots)

    def _form_without_the_lost(
        self, members: list[RankedWorker], formation: FormGroup, world_size_before_forming: int | None
    ) -> Recovering | None:
        """Form the group at `formation.size`; a member that died meanwhile (another node lost) is left out: the
        Recovering that forms the group again without it. `world_size_before_forming`: see Recovering (None: the
        group trained since the control plane last heard of a loss)."""
        try:
            self._form(members, formation.size)
        except RayActorError:
            lost = self.group.unresponsive(PROBE_TIMEOUT_S, PROBE_GRACE_S)
            if not lost:
                raise
            return Recovering(
                lost,
                f"lost rank(s) {sorted(worker.rank for worker in lost)} of the group being formed "
                f"on node(s) {sorted({worker.node_id[:12] for worker in lost})}",
                world_size_before_forming=world_size_before_forming,
            )
        return None

    def _form(self, members: list[RankedWorker], size: int) -> None:
        """Form the group of the first `size` members; the others are ended."""
        for extra in members[size:]:
            self.ray.kill(extra.actor)
        self.group.form(members[:size])
        # Which process is which rank: a warm pool worker belongs to the control plane's Ray job, not this one, so the
        # dashboard lists it under that job; its actor id finds it there.
        for worker in self.group.workers:
            log.info(
                "rank %d: pid %d (training in pid %d) on node %s, Ray actor %s (%s)",
                worker.rank,
                worker.pid,
                worker.training_pid,
                worker.node_id[:12],
                worker.actor_id,
                worker.name or "unnamed",
            )

    def _report_failure(self, reason: str) -> None:
        """What rank 0 recorded before the failure goes out first."""
        if self._poll is not None:
            self._forward(
                PollResult(drained=self._poll.drain(self._rank0_metrics.acknowledged(self.reporter.handled_seq)))
            )
        self._report(state="FAILED", message=reason[-_MAX_MESSAGE:])
