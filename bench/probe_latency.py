"""How long a training job's live workers take to answer the driver's probe: the margin behind PROBE_GRACE_S.

    python bench/probe_latency.py [--strategy fsdp] [--seconds 40]

After a failed collective the driver sends every worker a heartbeat and declares lost whoever has not answered
PROBE_GRACE_S after another one did (workers/driver/worker_group.py, `unresponsive`): a dead worker's call hangs
until Ray declares its node dead, so the grace is added to every recovery from a node's death, and a live worker
slower than it would be taken for dead. This runs a job of two workers (one per simulated node, in-memory snapshots
on) on this machine's CPUs, both busy training, and probes them as the driver does, every 50 ms: it prints the time
to the first answer and from the first answer to the last (what the grace must exceed), median, 99th percentile and
maximum, beside the grace.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import ray  # noqa: E402

from bench.overhead import wait_for_warm_pool  # noqa: E402
from harness.local_control_plane import watch_cluster  # noqa: E402
from harness.simulated_cluster import SimulatedCluster, control_plane_on  # noqa: E402
from ringmaster.workers.driver.controller import PROBE_GRACE_S  # noqa: E402
from ringmaster.workers.warm_pool import pool_statuses, pools_by_node  # noqa: E402


def _summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "median_ms": round(1e3 * statistics.median(ordered), 1),
        "p99_ms": round(1e3 * ordered[int(len(ordered) * 0.99)], 1),
        "max_ms": round(1e3 * ordered[-1], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="fsdp", choices=["ddp", "zero1", "fsdp"])
    parser.add_argument("--seconds", type=float, default=40.0, help="how long to probe the training job")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="probe-") as scratch:
        cluster = SimulatedCluster(nodes=2)
        try:
            # The job's workers come from the warm pool, whose named actors this process can reach.
            with control_plane_on(cluster, Path(scratch) / "ringmaster", warm_workers_per_node=1) as server:
                client = server.client()
                watch_cluster(cluster)
                wait_for_warm_pool(2)
                job = client.submit(
                    {
                        "name": "probe-latency",
                        "model": "tiny-gpt",
                        "strategy": args.strategy,
                        "model_options": {"dim": 256, "n_layers": 6},
                        "workers": {"min": 2, "max": 2, "cpus_per_worker": 1},
                        "train": {
                            "steps": 100_000,
                            "global_batch_size": 16,
                            "micro_batch_size": 4,
                            "lr": 0.001,
                            "seed": 0,
                        },
                        "checkpoint": {"every_steps": 0, "keep": 1, "in_memory": {"replicas": 1}},
                    }
                )
                while not client.metrics(job["id"])["items"]:
                    time.sleep(0.2)
                statuses = pool_statuses(
                    [name for nodes in pools_by_node().values() for names in nodes.values() for name in names]
                )
                workers = [handle for handle, status in statuses.values() if status["claimant"] is not None]
                if len(workers) != 2:
                    raise SystemExit(f"expected the job's 2 workers among the pool's, found {len(workers)}")
                first_answers, spreads = [], []
                deadline = time.monotonic() + args.seconds
                while time.monotonic() < deadline:
                    sent = time.monotonic()
                    pending, first = [worker.heartbeat.remote() for worker in workers], None
                    while pending:
                        _, pending = ray.wait(pending, num_returns=1)
                        first = first or time.monotonic()
                    first_answers.append(first - sent)
                    spreads.append(time.monotonic() - first)
                    time.sleep(0.05)
                state = client.job(job["id"])["state"]
                steps = max(point["step"] for point in client.metrics(job["id"])["items"])
                client.cancel(job["id"])
        finally:
            cluster.shutdown()
    if state != "RUNNING":
        raise SystemExit(f"the job left RUNNING while probed ({state}): the figures are not of a training job")
    print(
        json.dumps(
            {
                "strategy": args.strategy,
                "probes": len(spreads),
                "steps_trained_meanwhile": steps,
                "first_answer": _summary(first_answers),
                "last_after_first": _summary(spreads),
                "probe_grace_ms": 1e3 * PROBE_GRACE_S,
                "grace_over_max_spread": round(PROBE_GRACE_S / max(spreads), 1),
            }
        )
    )


if __name__ == "__main__":
    main()
