"""The job driver: the entrypoint of each Ray job ringmaster submits (`python -m workers.driver`).

It takes the placement group the dispatcher reserved, starts the worker group, streams what rank 0
records to the control plane, and reports the outcome. The training loop never sees any of this.
"""

from __future__ import annotations

import argparse
import base64
import logging
import re
import signal
import sys
import time
import traceback
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util import get_placement_group
from ray.util.placement_group import remove_placement_group

from service.ray_cluster import NAMESPACE
from service.reports import CheckpointRecord, MetricPoint, RankMemory
from service.spec import JobSpec
from workers.reporter import Reporter
from workers.worker_group import WorkerGroup

log = logging.getLogger("ringmaster.driver")

POLL_INTERVAL_S = 0.25
COLLECTIVE_TIMEOUT_S = 60.0
_MAX_MESSAGE = 20_000


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def describe_task_error(error: RayTaskError) -> str:
    """The remote traceback as plain text, headed by where it was raised."""
    where, _, frames = _ANSI_ESCAPE.sub("", str(error)).partition("\n")
    return f"training raised an exception in {where.strip()}\nTraceback (most recent call last):\n{frames}"


class JobDriver:
    def __init__(self, spec: JobSpec, job_id: str, placement_group_name: str, storage_uri: str, reporter: Reporter) -> None:
        self.spec = spec
        self.job_id = job_id
        self.placement_group_name = placement_group_name
        self.storage_root = f"{storage_uri.rstrip('/')}/{job_id}"
        self.reporter = reporter
        self.workers: WorkerGroup | None = None
        self._memory_pending: set[int] = set()  # ranks whose state-memory report has not arrived yet

    def run(self) -> int:
        """Train to the end; 0 when the job succeeded, 1 when it failed (reported either way)."""
        group = get_placement_group(self.placement_group_name)
        try:
            log.info("starting workers")
            self.workers = WorkerGroup.start(self.spec, group, group.bundle_count, COLLECTIVE_TIMEOUT_S)
            self._memory_pending = {worker.rank for worker in self.workers.workers}
            nodes = len({worker.node_id for worker in self.workers.workers})
            self.reporter.report(state="RUNNING", message=f"training on {self.workers.world_size} workers across {nodes} node(s)")
            results = self._train()
        except RayTaskError as error:
            self._fail(describe_task_error(error))
            return 1
        except RayActorError as error:
            self._fail(f"a worker died: {error}")
            return 1
        except Exception:  # noqa: BLE001 — whatever broke, the job's record must say what
            self._fail(f"driver error:\n{traceback.format_exc()}")
            return 1
        finally:
            self._release(group)
        final = results[0]
        self.reporter.report(state="SUCCEEDED", message=f"finished at step {final.get('step')}, checkpoint {final.get('checkpoint_uri')}")
        return 0

    def _train(self) -> list[dict[str, Any]]:
        assert self.workers is not None
        pending = self.workers.train(self.spec, self.job_id, self.storage_root)
        futures = list(pending)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_INTERVAL_S)
            for future in done:
                ray.get(future)  # surfaces a rank's failure now rather than after the others hang
            self._forward_progress()
        self._forward_progress()
        return ray.get(futures)

    def _forward_progress(self) -> None:
        """Forward rank 0's metrics and checkpoints; until every rank's memory report (measured once,
        after its first optimizer step) has arrived, drain the other ranks too."""
        assert self.workers is not None
        sources = [worker for worker in self.workers.workers if worker.rank == 0 or worker.rank in self._memory_pending]
        drained = ray.get([worker.actor.drain.remote() for worker in sources])
        memory = [RankMemory(**measured) for batch in drained for measured in batch["memory"]]
        self._memory_pending -= {measured.rank for measured in memory}
        first = drained[0]
        if first["metrics"] or first["checkpoints"] or memory:
            self.reporter.report(
                metrics=[MetricPoint(**point) for point in first["metrics"]],
                checkpoints=[CheckpointRecord(**record) for record in first["checkpoints"]],
                memory=memory,
            )

    def _fail(self, message: str) -> None:
        log.error(message)
        if self.workers is not None:
            try:
                self._forward_progress()
            except Exception:  # noqa: BLE001 — rank 0 may be the one that died
                pass
        self.reporter.report(state="FAILED", message=message[-_MAX_MESSAGE:])

    def _release(self, group) -> None:
        if self.workers is not None:
            self.workers.shutdown()
        remove_placement_group(group)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers.driver", description=__doc__)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--placement-group", required=True)
    parser.add_argument("--ray-address", help="the cluster's GCS address; without it, the one the Jobs API gives the driver")
    parser.add_argument("--failures", type=int, default=0, help="failures the job already had in earlier attempts")
    parser.add_argument("--api-url", required=True)
    parser.add_argument("--storage-uri", required=True)
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
    reporter = Reporter(args.api_url, args.job_id, args.attempt)
    try:
        code = JobDriver(spec, args.job_id, args.placement_group, args.storage_uri, reporter).run()
    finally:
        delivered = reporter.close()
    log.info("job %s attempt %d ended with code %d after %.1fs (reports delivered: %s)",
             args.job_id, args.attempt, code, time.monotonic() - started, delivered)
    return code


if __name__ == "__main__":
    sys.exit(main())
