"""Recovery on GPUs (NCCL): 2 GPU workers, one's node killed mid-run; steps lost and time to the next step.

    python bench/gpu_recovery.py [--steps-before-kill 30]

Needs a machine with at least 2 CUDA devices (NCCL puts one rank on each): a simulated cluster of two nodes,
one GPU each, trains tiny-gpt with FSDP zero3 on `workers {min: 1, max: 2, gpus_per_worker: 1}` with
in-memory snapshots on (their default across nodes). One node is killed after `--steps-before-kill` steps; the
survivor aborts its broken NCCL communicator (the worker's group abort; the watchdog set to clean up, not to
end the process: TORCH_NCCL_ASYNC_ERROR_HANDLING=2), the group shrinks to it, and it resumes from the snapshot
its peer's shard was copied into its pinned host memory from. Prints one JSON object: steps redone (counted
from each rank's own step record), seconds from the kill to the next completed step, where the restore came
from and its storage reads. Without 2 GPUs it prints why and exits 2. Runs in well under 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (found := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-before-kill", type=int, default=30)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    import torch

    if torch.cuda.device_count() < 2:
        print(json.dumps({"ran": False, "why": f"{torch.cuda.device_count()} CUDA device(s) here; NCCL needs one per "
                          "rank and this benchmark two ranks"}))
        raise SystemExit(2)

    from ray.util.state import list_actors

    from harness.simulated_cluster import SimulatedCluster, control_plane_on

    spec = {
        "name": "gpu-recovery", "model": "tiny-gpt", "strategy": "fsdp", "parallel": {"shard": "zero3"},
        "model_options": {"n_layers": 4, "dim": 256, "n_heads": 8, "seq_len": 128},
        "workers": {"min": 1, "max": 2, "cpus_per_worker": 1, "gpus_per_worker": 1},
        "train": {"steps": args.steps, "global_batch_size": 32, "micro_batch_size": 16, "lr": 1e-3, "seed": 0,
                  "record_sample_ids": True},
        "checkpoint": {"every_steps": 50, "keep": 2},
    }
    cluster = SimulatedCluster(nodes=2, cpus_per_node=2, gpus_per_node=1)
    try:
        with tempfile.TemporaryDirectory() as data_dir, control_plane_on(cluster, Path(data_dir)) as server:
            client = server.client()
            job = client.submit(spec)
            _wait(lambda: any(r["step"] >= args.steps_before_kill for r in client.metrics(job["id"])["items"]),
                  180, "the job never reached the kill")
            actors = list_actors(filters=[("class_name", "=", "TrainWorker"), ("state", "=", "ALIVE")])
            killed_at = time.time()
            cluster.kill_node(cluster.node_by_id(sorted(actor["node_id"] for actor in actors)[-1]))
            next_step = _wait(lambda: [r for r in client.metrics(job["id"])["items"]
                                       if r["loss"] is not None and r["wall_time"] > killed_at
                                       and r["world_size"] == 1], 180, "no step after the kill")
            events = client.events(job["id"])["items"]
            restore = next((e["data"] for e in events if e["data"] and "restored_step" in e["data"]), {})
            client.cancel(job["id"])
            storage = Path(server.plane.settings.resolved_storage_uri()) / job["id"] / "sample-ids"
            generations: dict[int, set[int]] = {}
            for record_file in storage.glob("*.jsonl"):
                for line in record_file.read_text().splitlines():
                    record = json.loads(line)
                    generations.setdefault(record["generation"], set()).add(record["step"])
            computed = Counter(step for steps in generations.values() for step in steps)
            recovering = next(e for e in events if e["to_state"] == "RECOVERING")
            print(json.dumps({
                "ran": True, "gpus": [torch.cuda.get_device_name(i) for i in range(2)],
                "steps_redone": sum(1 for times in computed.values() if times > 1),
                "kill_to_next_step_s": round(min(r["wall_time"] for r in next_step) - killed_at, 2),
                "kill_to_recovering_s": round(datetime.fromisoformat(recovering["at"]).timestamp() - killed_at, 2),
                "restored_from": restore.get("source"), "storage_reads": restore.get("storage_reads"),
                "restore_s": restore.get("restore_s"),
            }, indent=2))
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
