"""The job driver: the entrypoint of each Ray job ringmaster submits (`python -m ringmaster.workers.driver`).

A controller loop over a worker group. It takes the placement group the dispatcher reserved,
forms the group, streams what the workers record to the control plane, and when workers are lost
(actor death, a missed heartbeat, a broken collective) keeps the survivors, re-forms the group at
the largest size in [workers.min, workers.max] whose workers are ready now, and resumes from the
latest committed checkpoint. Workers still to be started (a replacement node, returning capacity)
warm up while the group trains, and the group grows to them at a checkpoint boundary once they are
warm; only a group that would be below workers.min waits for cold workers.
"""

from __future__ import annotations

import argparse
import base64
import logging
import os
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util import get_placement_group
from ray.util.placement_group import remove_placement_group

from ringmaster.service.naming import NAMESPACE, submission_id_for
from ringmaster.service.reports import REPORT_TOKEN_ENV, CheckpointRecord, MetricPoint, RankMemory
from ringmaster.service.spec import JobSpec
from ringmaster.workers.metric_ledger import DrainedMetrics
from ringmaster.workers.reporter import Reporter
from ringmaster.workers.standby import StandbyPool
from ringmaster.workers.worker_group import Heartbeats, RankedWorker, Slot, WorkerGroup, placed_slots

log = logging.getLogger("ringmaster.driver")

POLL_INTERVAL_S = 0.1
# Rank 0's metrics are fetched, and reported, this often: each fetch takes the GIL from its training thread, and
# each report is a database transaction, both on CPUs that training may share.
DRAIN_INTERVAL_S = 1.0
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 3.0  # a frozen node is declared lost within this (plus one interval)
PROBE_TIMEOUT_S = 2.0  # after a failed collective: who is still there?
PROBE_GRACE_S = 0.5  # ... and who has not answered this long after another worker did
COLLECTIVE_TIMEOUT_S = 60.0  # backstop; failures are normally noticed by the driver long before
START_TIMEOUT_S = 120.0  # first start: worker processes import torch
REPLACEMENT_WAIT_S = 5.0  # below workers.min with spare capacity: wait this long for Ray to move the lost bundles
CAPACITY_WAIT_S = 60.0  # fewer than workers.min placeable: wait this long before giving up
# A live standby answers at once and a dead one fails at once; only a loaded machine handling a node's death needs more.
STANDBY_PROBE_TIMEOUT_S = 10.0
FINAL_REPORT_WAIT_S = 600.0  # the control plane may be restarting when the job ends
_MAX_MESSAGE = 20_000
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
# Text of the exceptions a rank raises when a peer or the transport is gone, not the user's code.
_COMMUNICATION_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "DistBackendError",
                           "DistNetworkError", "NCCL error", "Timed out", "timed out", "aborted")


def describe_task_error(error: RayTaskError) -> str:
    """The remote traceback as plain text, headed by where it was raised."""
    where, _, frames = _ANSI_ESCAPE.sub("", str(error)).partition("\n")
    return f"training raised an exception in {where.strip()}\nTraceback (most recent call last):\n{frames}"


def is_communication_failure(error: RayTaskError) -> bool:
    text = str(error)
    return any(marker in text for marker in _COMMUNICATION_FAILURES)


@dataclass
class Outcome:
    """How one run of the group ended: finished, lost workers, wants to grow, the user's code failed, or the control
    plane ended the attempt (cancelled, or superseded)."""

    kind: str
    results: list[dict[str, Any]] = field(default_factory=list)
    lost: list[RankedWorker] = field(default_factory=list)
    reason: str = ""


class JobDriver:
    def __init__(self, spec: JobSpec, job_id: str, placement_group_name: str, storage_uri: str, reporter: Reporter,
                 failures_so_far: int = 0, claimant: str | None = None, attempt: int = 1) -> None:
        """`claimant`: this attempt's Ray submission id, under which it takes warm pool workers (None: it never does).
        `attempt`: this attempt's number, which the metric points its checkpoints keep name."""
        self.spec = spec
        self.job_id = job_id
        self.attempt = attempt
        self.placement_group_name = placement_group_name
        self.storage_root = f"{storage_uri.rstrip('/')}/{job_id}"
        # JobSpec.resume_from: the other job's storage, resumed from while this job has no checkpoint of its own.
        self.resume_from_root = f"{storage_uri.rstrip('/')}/{spec.resume_from}" if spec.resume_from else None
        self.reporter = reporter
        self.failure_budget = spec.max_failures - failures_so_far
        self.group = WorkerGroup(spec, COLLECTIVE_TIMEOUT_S, claimant)
        self.standby = StandbyPool(spec.workers, self.group)
        self.slots: list[Slot] = []
        self.lost_nodes: set[str] = set()
        self._memory_pending: set[int] = set()
        self._rank0_metrics = DrainedMetrics()

    def run(self) -> int:
        """Train to the end; 0 when the job succeeded, 1 when it failed (reported either way)."""
        admission = get_placement_group(self.placement_group_name)
        self.slots = [Slot(admission, index) for index in range(admission.bundle_count)]
        try:
            # Reserve standby capacity first (it does not wait): standbys start while the group forms.
            self.standby.top_up(self.spec.workers.standby, list, self._spare_capacity)
            began = time.monotonic()
            members = self.group.launch(self.slots, START_TIMEOUT_S)
            log.info("%d worker actor(s) running after %.2fs (%d from the warm pool)", len(members),
                     time.monotonic() - began, self.group.pooled_started)
            if len(members) < self.spec.workers.min:
                return self._fail(f"only {len(members)} of {self.spec.workers.min} workers started")
            self._form(members)
            log.info("process group formed after %.2fs", time.monotonic() - began)
            self.reporter.report(state="RUNNING", message=f"training on {self.group.world_size} workers across "
                                 f"{len(self.group.nodes)} node(s)", details={
                                     "world_size": self.group.world_size, "warm_pool_workers": self.group.pooled_started})
            while True:
                outcome = self._supervise()
                if outcome.kind == "finished":
                    final = outcome.results[0]
                    self.reporter.report(state="SUCCEEDED", message=f"finished at step {final['step']}, checkpoint {final['checkpoint_uri']}")
                    return 0
                if outcome.kind == "ended":
                    log.info("the control plane ended this attempt (job %s): stopping", self.reporter.ended_state)
                    return 0
                if outcome.kind == "user_error":
                    return self._fail(outcome.reason)
                if outcome.kind == "lost":
                    self.failure_budget -= 1
                    if self.failure_budget < 0:
                        return self._fail(f"{outcome.reason}; max_failures ({self.spec.max_failures}) exhausted")
                if not self._regroup(outcome):
                    return 1
        except Exception:  # noqa: BLE001 — whatever broke, the job's record must say what
            return self._fail(f"driver error:\n{traceback.format_exc()}")
        finally:
            self.group.shutdown()
            self.standby.shutdown()
            remove_placement_group(admission)

    # -- running ----------------------------------------------------------------------------

    def _supervise(self) -> Outcome:
        """Run the group until it finishes, loses workers, or stops at a checkpoint to grow."""
        self._rank0_metrics.restart()
        futures = self.group.train(self.job_id, self.storage_root, self.resume_from_root, self.attempt)
        pending = list(futures)
        heartbeats = Heartbeats(HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S)
        lost: list[RankedWorker] = []
        errors: list[RayTaskError] = []
        stopping = False
        next_drain = time.monotonic() + DRAIN_INTERVAL_S
        while pending and not (lost or errors):
            if self.reporter.ended.is_set():
                return Outcome("ended")  # cancelled, or superseded: the finally blocks free the workers and bundles
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_INTERVAL_S)
            for ref in done:
                try:
                    ray.get(ref)
                except RayActorError:
                    lost.append(futures[ref])
                except RayTaskError as error:
                    errors.append(error)
            lost += [worker for worker in heartbeats.check(self.group.workers) if worker not in lost]
            if time.monotonic() >= next_drain:
                self._forward_progress()
                next_drain = time.monotonic() + DRAIN_INTERVAL_S
            self._keep_workers_warm()
            if not stopping and self._ready_to_grow():
                self.group.request_stop()  # every rank stops after this step and checkpoints
                stopping = True
        if errors and not lost:
            # A broken collective: find out whether a peer is gone, or the error was the user's own.
            probing = time.monotonic()
            lost = self.group.unresponsive(PROBE_TIMEOUT_S, PROBE_GRACE_S)
            log.info("a collective failed; probe found %d unresponsive worker(s) in %.2fs", len(lost), time.monotonic() - probing)
        elif lost:
            log.info("lost %d worker(s): actor death or a missed heartbeat", len(lost))
        if lost or errors:
            if lost:
                nodes = sorted({worker.node_id[:12] for worker in lost})
                return Outcome("lost", lost=lost, reason=f"lost rank(s) {sorted(w.rank for w in lost)} on node(s) {nodes}")
            if all(is_communication_failure(error) for error in errors):
                return Outcome("lost", reason=f"a collective failed with every worker alive: {str(errors[0])[-300:]}")
            user_error = next(error for error in errors if not is_communication_failure(error))
            return Outcome("user_error", reason=describe_task_error(user_error))
        self._forward_progress()  # what the ranks recorded since the last fetch
        results = ray.get(list(futures))
        return Outcome("grow" if any(result["stopped"] for result in results) else "finished", results=results)

    def _keep_workers_warm(self) -> None:
        """Warm the workers the group would grow by, and the standbys the spec asks for."""
        missing = self.spec.workers.max - self.group.world_size
        for ready in self.standby.top_up(missing + self.spec.workers.standby, self._spare_slots, self._spare_capacity):
            if missing:
                self.reporter.report(message=f"worker warm on node {ready.node_id[:12]}: the group grows to it at the "
                                     "next step", details={"warm_node": ready.node_id, "warm_pid": ready.pid})
            else:
                self.reporter.report(message=f"standby worker ready on node {ready.node_id[:12]}",
                                     details={"standby_node": ready.node_id, "standby_pid": ready.pid})

    def _ready_to_grow(self) -> bool:
        """Below max with warm workers: all that are missing, or all that could be started."""
        missing = self.spec.workers.max - self.group.world_size
        warm = len(self.standby.ready)
        return missing > 0 and warm > 0 and (warm >= missing or not self.standby.starting)

    def _forward_progress(self) -> None:
        """Forward rank 0's metrics, checkpoints and events, and each rank's one memory report."""
        sources = [worker for worker in self.group.workers if worker.rank == 0 or worker.rank in self._memory_pending]
        if not sources:
            return  # every worker is gone
        acknowledged = self._rank0_metrics.acknowledged(self.reporter.handled_seq)
        try:
            drained = ray.get([worker.actor.drain.remote(acknowledged if worker.rank == 0 else None) for worker in sources],
                              timeout=PROBE_TIMEOUT_S)
        except (RayActorError, ray.exceptions.GetTimeoutError):
            return  # the heartbeats will name who is gone
        memory = [RankMemory(**measured) for batch in drained for measured in batch["memory"]]
        self._memory_pending -= {measured.rank for measured in memory}
        first = drained[0]
        if first["metrics"] or first["checkpoints"] or memory:
            seq = self.reporter.report(
                metrics=[MetricPoint(**point) for point in first["metrics"]],
                checkpoints=[CheckpointRecord(**record) for record in first["checkpoints"]],
                memory=memory,
            )
            self._rank0_metrics.forwarded(seq, len(first["metrics"]))
        for event in first.get("events", []):
            self.reporter.report(message=event["message"], details=event["details"])

    # -- re-forming ---------------------------------------------------------------------------

    def _form(self, members: list[RankedWorker]) -> None:
        world = min(self.spec.workers.max, len(members))
        for extra in members[world:]:
            ray.kill(extra.actor, no_restart=True)
        self.group.form(members[:world])
        self._memory_pending = {worker.rank for worker in self.group.workers}

    def _free_slots(self) -> list[Slot]:
        taken = {worker.slot for worker in self.group.workers} | set(self.standby.slots)
        return [slot for slot in self.slots if slot not in taken]

    def _spare_slots(self) -> list[Slot]:
        """Free bundles that sit on live nodes now (Ray moved them after a node died, or capacity returned)."""
        return placed_slots(self._free_slots(), self.lost_nodes)

    def _spare_capacity(self) -> int:
        """How many more workers unreserved resources could hold now."""
        available = ray.available_resources()
        need = self.spec.workers
        if need.gpus_per_worker:
            return int(available.get("GPU", 0) // need.gpus_per_worker)
        return int(available.get("CPU", 0) // need.cpus_per_worker)

    def _regroup(self, outcome: Outcome) -> bool:
        """Keep the survivors, add workers where bundles can be placed now, form the next generation. False: the job
        failed (reported), or the control plane ended the attempt meanwhile."""
        started = time.monotonic()
        before = self.group.world_size
        if outcome.kind == "lost":
            self.lost_nodes |= {worker.node_id for worker in outcome.lost}
            self.reporter.report(state="RECOVERING", message=f"{outcome.reason}; re-forming the group", details={
                "lost_ranks": sorted(worker.rank for worker in outcome.lost),
                "lost_nodes": sorted({worker.node_id for worker in outcome.lost}),
                "lost_pids": sorted(worker.pid for worker in outcome.lost),
                "world_size_before": before,
            })
            self.group.remove(outcome.lost)
        wanted = self.spec.workers.max - self.group.world_size
        if self.group.world_size + len(self.standby.ready) < self.spec.workers.min and self.standby.starting:
            # Too few to train on: the workers warming up are the quickest to come.
            self.standby.wait_for_starting(START_TIMEOUT_S)
        standbys = self.standby.take(wanted, self.lost_nodes, STANDBY_PROBE_TIMEOUT_S) if wanted else []
        self.slots += [slot for slot in [worker.slot for worker in standbys] + self.standby.freed if slot not in self.slots]
        wanted -= len(standbys)
        if self.group.world_size + len(standbys) >= self.spec.workers.min:
            wanted = 0  # train now; the missing workers warm up meanwhile and the group grows to them
        if wanted and len(self._spare_slots()) < wanted and self._spare_capacity():
            # Spare capacity exists: Ray moves the lost bundles onto it once it declares their node dead.
            deadline = time.monotonic() + REPLACEMENT_WAIT_S
            while len(self._spare_slots()) < wanted and time.monotonic() < deadline:
                time.sleep(0.2)
        give_up = time.monotonic() + CAPACITY_WAIT_S
        while True:
            spare = self._spare_slots()[:wanted]
            added = self.group.launch(spare, START_TIMEOUT_S) if wanted else []
            members = self.group.workers + standbys + added
            log.info("regroup after %.1fs: %d survivor(s), %d of %d new worker(s) started",
                     time.monotonic() - started, self.group.world_size, len(added), len(spare))
            if len(members) >= self.spec.workers.min:
                break
            for worker in added:
                ray.kill(worker.actor, no_restart=True)
            if self.reporter.ended.is_set():
                log.info("the control plane ended this attempt (job %s) while it waited for capacity", self.reporter.ended_state)
                return False
            if time.monotonic() > give_up:
                self._fail(f"{outcome.reason}; only {len(members)} of workers.min {self.spec.workers.min} can be placed")
                return False
            time.sleep(1.0)
        self._form(members)
        log.info("formed generation %d at %d workers after %.1fs", self.group.generation, self.group.world_size,
                 time.monotonic() - started)
        # Rank 0 names the checkpoint it will resume from: reading checkpoints takes torch, which the driver never
        # imports (2-3 s of CPU, taken from training on a small machine).
        resumed = ray.get(self.group.workers[0].actor.resume_step.remote(self.storage_root, self.resume_from_root))
        details = {"world_size": self.group.world_size, "world_size_before": before, "resumed_from_step": resumed,
                   "standby_workers_used": len(standbys), "workers_missing": self.spec.workers.max - self.group.world_size,
                   "nodes": len(self.group.nodes), "regroup_s": round(time.monotonic() - started, 3)}
        message = f"re-formed at {self.group.world_size} workers (was {before}), resuming from step {resumed}"
        if outcome.kind == "lost":
            self.reporter.report(state="RUNNING", message=message, details=details)
        else:
            self.reporter.report(message=f"capacity returned: {message}", details=details)
        return True

    def _fail(self, message: str) -> int:
        log.error(message)
        self._forward_progress()
        self.reporter.report(state="FAILED", message=message[-_MAX_MESSAGE:])
        return 1


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ringmaster.workers.driver", description=__doc__)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--ray-address", help="the cluster's GCS address; without it, the one the Jobs API gives the driver")
    parser.add_argument("--placement-group", required=True)
    parser.add_argument("--api-url", required=True)
    parser.add_argument("--storage-uri", required=True)
    parser.add_argument("--failures", type=int, default=0, help="failures the job already had in earlier attempts")
    parser.add_argument("--spec-b64", required=True, help="the JobSpec as base64-encoded JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parse(argv)
    spec = JobSpec.model_validate_json(base64.b64decode(args.spec_b64))
    # `ray job stop` sends SIGTERM: unwind through the finally blocks so actors and the group are freed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()
    ray.init(address=args.ray_address, namespace=NAMESPACE, logging_level=logging.WARNING)
    log.info("connected to Ray after %.2fs", time.monotonic() - started)
    # The dispatcher puts this attempt's report secret in the Ray job's environment, not on its command line.
    reporter = Reporter(args.api_url, args.job_id, args.attempt, token=os.environ.get(REPORT_TOKEN_ENV))
    try:
        code = JobDriver(spec, args.job_id, args.placement_group, args.storage_uri, reporter, args.failures,
                         claimant=submission_id_for(args.job_id, args.attempt), attempt=args.attempt).run()
    finally:
        # The group is gone by now; waiting costs only this process, while giving up would make the reconciler
        # rerun a finished job as a failed attempt.
        delivered = reporter.close(timeout_s=FINAL_REPORT_WAIT_S)
    log.info("job %s attempt %d ended with code %d after %.1fs (reports delivered: %s)",
             args.job_id, args.attempt, code, time.monotonic() - started, delivered)
    return code


if __name__ == "__main__":
    sys.exit(main())
