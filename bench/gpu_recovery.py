"""Recovery on GPUs (NCCL): 2 GPU workers, one's node killed mid-run; steps lost and time to the next step.

    python bench/gpu_recovery.py [--steps 80] [--steps-before-kill 30] [--without-gpus]

A simulated cluster of two nodes, one GPU each, trains tiny-gpt with FSDP zero3 on
`workers {min: 1, max: 2, gpus_per_worker: 1}` with in-memory snapshots on (their default across nodes). One
node is killed after `--steps-before-kill` steps; the survivor aborts its broken NCCL communicator (the worker's
group abort; the watchdog set to clean up, not to end the process: TORCH_NCCL_ASYNC_ERROR_HANDLING=2), the group
shrinks to it, and it resumes from the snapshot its peer's shard was copied into its pinned host memory from.

On a machine with one GPU both nodes share it (harness/simulated_cluster.py: each node its own host to NCCL,
which then talks over sockets): the abort, the survivor's process and the restore are the real ones, the step
times are not a multi-GPU machine's. `--without-gpus` runs the same script with gloo on CPUs, to check the
script itself where no GPU is. Prints one JSON object: steps computed twice (from each rank's own step record),
seconds from the kill to the next completed step, whether the surviving rank's actor and training process are the
ones that trained before the kill, where the restore came from and its storage reads, and the job's end. Without a
CUDA device (and without --without-gpus) it prints why and exits 2. Runs in well under 5 minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def _train_workers() -> dict[str, dict]:
    from ray.util.state import list_actors

    return {
        actor["actor_id"]: actor
        for actor in list_actors(filters=[("class_name", "=", "TrainWorker"), ("state", "=", "ALIVE")], detail=True)
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--steps-before-kill", type=int, default=30)
    parser.add_argument("--without-gpus", action="store_true", help="gloo on CPUs: checks the script, not NCCL")
    args = parser.parse_args()

    import torch

    gpus = 0 if args.without_gpus else 1
    if gpus and not torch.cuda.is_available():
        print(json.dumps({"ran": False, "why": "no CUDA device here (--without-gpus checks the script on CPUs)"}))
        raise SystemExit(2)

    from harness.simulated_cluster import SimulatedCluster, control_plane_on

    spec = {
        "name": "gpu-recovery",
        "model": "tiny-gpt",
        "strategy": "fsdp",
        "parallel": {"shard": "zero3"},
        "model_options": {"n_layers": 4, "dim": 256, "n_heads": 8, "seq_len": 128},
        "workers": {"min": 1, "max": 2, "cpus_per_worker": 2, "gpus_per_worker": gpus},  # a node each
        "train": {
            "steps": args.steps,
            "global_batch_size": 32,
            "micro_batch_size": 16,
            "lr": 1e-3,
            "seed": 0,
            "record_sample_ids": True,
        },
        "checkpoint": {"every_steps": 50, "keep": 2},
    }
    cluster = SimulatedCluster(nodes=2, cpus_per_node=2, gpus_per_node=gpus)
    try:
        with tempfile.TemporaryDirectory() as data_dir, control_plane_on(cluster, Path(data_dir)) as server:
            client = server.client()
            job_id = client.submit(spec)["id"]
            try:
                _recover(args, client, cluster, server, job_id, gpus)
            except TimeoutError as timeout:  # what the job went through, to see where it stopped
                print(
                    json.dumps(
                        {
                            "ran": False,
                            "why": str(timeout),
                            "job": client.job(job_id),
                            "events": client.events(job_id)["items"],
                        },
                        indent=2,
                        default=str,
                    )
                )
                raise SystemExit(1) from None
    finally:
        cluster.shutdown()


def _recover(args, client, cluster, server, job_id: str, gpus: int) -> None:
    import torch

    from ringmaster.workers.data.audit import read_steps_by_generation

    _wait(
        lambda: any(r["step"] >= args.steps_before_kill for r in client.metrics(job_id)["items"]),
        180,
        "the job never reached the kill",
    )
    before = _train_workers()
    victim_node = sorted(actor["node_id"] for actor in before.values())[-1]
    killed_at = time.time()
    cluster.kill_node(cluster.node_by_id(victim_node))
    next_step = _wait(
        lambda: [
            r
            for r in client.metrics(job_id)["items"]
            if r["loss"] is not None and r["wall_time"] > killed_at and r["world_size"] == 1
        ],
        180,
        "no step after the kill",
    )
    after = _train_workers()
    done = _wait(
        lambda: (row := client.job(job_id))["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") and row,
        240,
        "the job never ended",
    )
    events = client.events(job_id)["items"]
    rows = [r for r in client.metrics(job_id)["items"] if r["loss"] is not None]
    restore = next((e["data"] for e in events if e["data"] and "restored_step" in e["data"]), {})
    generations = read_steps_by_generation(Path(server.plane.settings.resolved_storage_uri()) / job_id)
    computed = Counter(step for steps in generations.values() for step in steps)
    recovering = next(e for e in events if e["to_state"] == "RECOVERING")
    survivors = [actor_id for actor_id, actor in before.items() if actor["node_id"] != victim_node]
    # The process that trains is the actor's child (workers/rank_process.py): the first formation's ranks and the
    # re-formed group's name it, per actor.
    formed = [
        {rank["actor_id"]: rank["training_pid"] for rank in e["data"]["ranks"]}
        for e in events
        if e["data"] and "ranks" in e["data"]
    ]
    first_pids, last_pids = formed[0], formed[-1]
    first_after_kill = min(r["step"] for r in next_step)
    print(
        json.dumps(
            {
                "ran": True,
                "backend": "gloo" if args.without_gpus else "nccl",
                "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
                "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                if gpus
                else [],
                "job_state": done["state"],
                "error": done.get("error"),
                "steps_computed": len(computed),
                "steps_computed_twice": sum(1 for n in computed.values() if n > 1),
                "formations": len(generations),
                "survivor_process_kept": bool(survivors)
                and len(formed) >= 2
                and all(
                    actor_id in after
                    and after[actor_id]["pid"] == before[actor_id]["pid"]
                    and actor_id in first_pids
                    and last_pids.get(actor_id) == first_pids[actor_id]
                    for actor_id in survivors
                ),
                "kill_to_recovering_s": round(datetime.fromisoformat(recovering["at"]).timestamp() - killed_at, 2),
                "kill_to_next_step_s": round(min(r["wall_time"] for r in next_step) - killed_at, 2),
                "first_step_after_kill": first_after_kill,
                "restored_from": restore.get("source"),
                "restored_step": restore.get("restored_step"),
                "storage_reads": restore.get("storage_reads"),
                "restore_s": restore.get("restore_s"),
                "step_time_s_median": {
                    "2 ranks": _median([r["step_time_s"] for r in rows if r["world_size"] == 2 and r["step_time_s"]]),
                    "1 rank": _median([r["step_time_s"] for r in rows if r["world_size"] == 1 and r["step_time_s"]]),
                },
                "loss_by_step_around_kill": {
                    f"{r['step']} ({r['world_size']} rank(s))": round(r["loss"], 4)
                    for r in rows
                    if abs(r["step"] - first_after_kill) <= 3
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
