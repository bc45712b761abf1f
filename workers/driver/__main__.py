"""`python -m ringmaster.workers.driver`: the Ray job's entrypoint, run by the Jobs API on the cluster."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

import ray

from ringmaster.service import driver_handoff
from ringmaster.service.naming import NAMESPACE, submission_id_for
from ringmaster.service.ray_internals import RayInternalKv
from ringmaster.service.spec import JobSpec
from ringmaster.workers.driver.bundles import Bundles
from ringmaster.workers.driver.controller import COLLECTIVE_TIMEOUT_S, RENDEZVOUS_TIMEOUT_S, Controller
from ringmaster.workers.driver.ray_facade import LiveRay, SystemClock
from ringmaster.workers.driver.script_controller import ScriptController
from ringmaster.workers.driver.standby import StandbyPool
from ringmaster.workers.driver.worker_group import WorkerGroup
from ringmaster.workers.reporter import Reporter
from ringmaster.workers.script.worker import ScriptWorker

log = logging.getLogger("ringmaster.driver")

FINAL_REPORT_WAIT_S = 600.0  # the control plane may be restarting when the job ends
METRICS_EXPORT_WAIT_CAP_S = 12.0  # Ray's default export interval is 10 s


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ringmaster.workers.driver", description=__doc__)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument(
        "--ray-address", help="the cluster's GCS address; without it, the one the Jobs API gives the driver"
    )
    parser.add_argument("--placement-group", required=True)
    parser.add_argument("--api-url", required=True)
    parser.add_argument("--storage-uri", required=True)
    parser.add_argument("--tenant", default="default", help="the job's tenant (a tag of its Ray metrics)")
    return parser.parse_args(argv)


def _own_node_temp_dir() -> str | None:
    """The temp dir of the Ray node this driver runs on, from the command line of the raylet above it (the Jobs API's
    supervisor, this process's parent, is a worker process that raylet started). Where several nodes share a host,
    ray.init otherwise attaches to the head's raylet, and the driver and the workers it owns would end with the head
    (RINGMASTER_DRIVER_RESOURCES places a driver off the head just so it outlives the head)."""
    pid = os.getppid()
    for _ in range(4):
        try:
            arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        if arguments and arguments[0].endswith(b"raylet"):
            return next((a.split(b"=", 1)[1].decode() for a in arguments if a.startswith(b"--temp_dir=")), None)
        pid = parent
    return None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per report: the log is the training's
    args = _parse(argv)
    started = time.monotonic()
    ray.init(
        address=args.ray_address, namespace=NAMESPACE, logging_level=logging.WARNING, _temp_dir=_own_node_temp_dir()
    )
    # After ray.init: its core worker installs a handler that writes a crash dump into the log on SIGTERM, which a
    # cancel sends; Python's own handler replaces it.
    signal.signal(signal.SIGTERM, _stop_requested)
    log.info("connected to Ray after %.2fs", time.monotonic() - started)
    submission_id = submission_id_for(args.job_id, args.attempt)
    # The attempt's report secret and spec wait in the cluster's key-value store, where the dashboard shows neither
    # (in the Ray job's environment or on its command line, its Jobs API would).
    try:
        handoff = driver_handoff.take(RayInternalKv(), submission_id)
    except (driver_handoff.HandoffMissing, driver_handoff.HandoffUnreadable) as error:
        log.error("%s", error)
        return 1
    spec = handoff.spec
    reporter = Reporter(args.api_url, args.job_id, args.attempt, token=handoff.report_token.get_secret_value())
    try:
        code = (_script_controller if spec.is_script else _managed_controller)(spec, args, submission_id, reporter)
    finally:
        # The group is gone by now; waiting costs only this process, while giving up would make the reconciler
        # rerun a finished job as a failed attempt.
        delivered = reporter.close(timeout_s=FINAL_REPORT_WAIT_S)
    log.info(
        "job %s attempt %d ended with code %d after %.1fs (reports delivered: %s)",
        args.job_id,
        args.attempt,
        code,
        time.monotonic() - started,
        delivered,
    )
    _outlive_one_metrics_export()
    return code


def _managed_controller(spec: JobSpec, args: argparse.Namespace, submission_id: str, reporter: Reporter) -> int:
    """Run a managed job (JobSpec.model): ringmaster's training loop on the group."""
    # Warm pool workers have imported no one's code: this job claims only those of its own runtime env's pool
    # (JobSpec.warm_pool), and starts the rest in its own env (inherited from this Ray job).
    group = WorkerGroup(
        spec,
        COLLECTIVE_TIMEOUT_S,
        claimant=submission_id,
        label=f"{spec.name}-{args.job_id[:8]}-a{args.attempt}",
        rendezvous_timeout_s=RENDEZVOUS_TIMEOUT_S,
    )
    bundles = Bundles(args.placement_group, spec.workers)
    return Controller(
        spec,
        args.job_id,
        args.attempt,
        args.storage_uri,
        reporter,
        group=group,
        bundles=bundles,
        standby=StandbyPool(group, bundles),
        ray=LiveRay(),
        clock=SystemClock(),
        tenant=args.tenant,
    ).run()


def _script_controller(spec: JobSpec, args: argparse.Namespace, submission_id: str, reporter: Reporter) -> int:
    """Run a script job (JobSpec.command): the team's own script on the group, as torchrun runs it. Its workers are
    ScriptWorkers, never the warm pool's training workers."""
    group = WorkerGroup(
        spec, COLLECTIVE_TIMEOUT_S, label=f"{spec.name}-{args.job_id[:8]}-a{args.attempt}", actor_class=ScriptWorker
    )
    return ScriptController(
        spec,
        args.job_id,
        args.attempt,
        args.storage_uri,
        reporter,
        group=group,
        bundles=Bundles(args.placement_group, spec.workers),
        ray=LiveRay(),
        clock=SystemClock(),
        tenant=args.tenant,
    ).run()


def _stop_requested(signum: int, frame: object) -> None:
    """`ray job stop` (a cancel) sends SIGTERM: unwind through the finally blocks so actors and the group are freed."""
    log.info("stop requested (SIGTERM, as a cancel sends it): ending the job's workers")
    sys.exit(128 + signum)


def _outlive_one_metrics_export() -> None:
    """Ray exports a process's metrics every metrics_report_interval_ms: the training series' last values (the final
    step) reach the metrics endpoint only if the driver lives through one more export. The job's state is reported
    and its placement groups are released by now: waiting holds nothing but this process."""
    try:
        from ray._raylet import Config  # type: ignore[attr-defined]  # the cluster's interval; Ray's stub omits it

        interval_s = Config.metrics_report_interval_ms() / 1000
    except Exception:
        return
    time.sleep(min(interval_s + 0.5, METRICS_EXPORT_WAIT_CAP_S))


if __name__ == "__main__":
    sys.exit(main())
