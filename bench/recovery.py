"""Time from a node's death to the first training step completed afterwards: ringmaster vs Ray Train, and vs Ray Train
with TorchftConfig (torchft's Manager, DDP and sampler).

    python bench/recovery.py [--rounds 1] [--scenarios replace shrink …] [--skip-ray-train] [--skip-torchft]
                             [--skip-script]

On one simulated cluster (ray.cluster_utils, nodes of one CPU, tiny-gpt on 2 workers):
- replace: a replacement node joins, then a worker's node is killed (workers {min: 2, max: 2}: the
           group waits for the replacement's cold start);
- replace-elastic: as replace with workers {min: 1, max: 2} (Ray Train num_workers=(1, 2)): the
           survivor trains on while the replacement warms up, and the group grows back to it; also
           prints the time until the group trains at 2 workers again (full_size_s);
- replace-spare: as replace, but the replacement node joined before the job and idles with a warm pool
           worker on it (RINGMASTER_WARM_WORKERS_PER_NODE); Ray Train's baseline is its replace time (it
           restarts every worker either way);
- standby: as replace, but the job keeps one warm standby worker (workers.standby: 1) on the spare
           node, which joins at once (Ray Train has no such thing: its baseline is its replace time);
- shrink:  a worker's node is killed with no replacement (ringmaster workers {min: 1, max: 2},
           Ray Train ScalingConfig(num_workers=(1, 2)));
- frozen:  a worker's node is SIGSTOPped; ringmaster's time to notice (its RECOVERING event).
In replace, replace-elastic and shrink a script-mode job (JobSpec.command; docs/jobs/script-mode.md) meets the same
node death after the managed one (--skip-script leaves it out): bench/bare_torchrun.py run unchanged, tiny-gpt on 2
workers with the same batch, reporting each step with ringmaster.report and saving every 10 steps to
RINGMASTER_CHECKPOINT_DIR. torchrun's semantics: every process of the group is stopped and started again at the size
the elastic rules choose, and the script resumes from its newest checkpoint; its row is "script" (seconds from the
kill to the first step the restarted group completes, a redone step included, as Ray Train's are counted), with
script_steps_redone (the newest step reported before the kill minus the step its rank 0 resumed after) and
script_ratio (to Ray Train's time). Measured on the shared 2-core machine (load average 12-22; `nice -n 19 python
bench/recovery.py --scenarios replace shrink --skip-torchft`, one round): replace: ringmaster 6.23 s (0 steps redone),
script mode 8.71 s (0 redone: the kill fell just after a checkpoint), Ray Train 10.98 s (20 redone), script_ratio
0.793; shrink: ringmaster 0.59 s, script mode 12.23 s (6 redone), Ray Train 71.4 s (20 redone), script_ratio 0.171;
and `--scenarios replace-elastic` run apart: ringmaster 0.52 s, script mode 8.63 s (0 redone, restarted at 2 workers),
Ray Train 8.68 s (20 redone), script_ratio 0.994. The script's group ran again 0.8-1.9 s after the kill; the rest was
the script's own start (docs/benchmarks.md).
Ray Train runs through bench/raytrain_recovery.py; in replace, so does Ray Train with TorchftConfig (pip install
torchft), whose surviving replica trains on (its pause compares with ringmaster's shrink, standby and replace-spare)
while the replacement heals from it (compared with ringmaster's replace), and which trains one small epoch so that
the samples it repeated or never used are counted from the ids its steps logged. Ringmaster's repeated samples come
from the ids its ranks recorded (train.record_sample_ids). Beside each time, the steps redone per node loss: the newest
step the old group completed (reported by the kill, or just after it) minus the step the new group resumed from
(ringmaster: its RUNNING event; Ray Train: the checkpoint it restored). Prints each measurement and the ratios; goals:
ringmaster ≤ 1/5 of Ray Train's time, shrink ≤ 5 s, frozen node noticed ≤ 5 s, ≤ 1 step redone.
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

from ray.util.state import list_actors, list_placement_groups  # noqa: E402

from bench.overhead import wait_for_warm_pool  # noqa: E402
from bench.raytrain_recovery import measure_ray_train  # noqa: E402
from harness.local_control_plane import watch_cluster  # noqa: E402
from harness.simulated_cluster import SimulatedCluster, control_plane_on, wait_for_step  # noqa: E402
from ringmaster.service.client import RingmasterClient  # noqa: E402
from ringmaster.workers.data.audit import read_effective_samples  # noqa: E402

KILL_AFTER_STEP = 30


def job_spec(scenario: str) -> dict:
    minimum = 1 if scenario in ("replace-elastic", "shrink", "frozen") else 2  # replace-spare: 2
    return {
        "name": f"recovery-{scenario}",
        "model": "tiny-gpt",
        "workers": {"min": minimum, "max": 2, "cpus_per_worker": 1, "standby": 1 if scenario == "standby" else 0},
        "train": {
            "steps": 100_000,
            "global_batch_size": 16,
            "micro_batch_size": 4,
            "lr": 0.001,
            "seed": 0,
            "record_sample_ids": True,
        },
        "checkpoint": {"every_steps": 10, "keep": 2},
    }


def _a_worker_node(cluster: SimulatedCluster, spared: str | None = None, worker_class: str = "TrainWorker"):
    from ringmaster.workers.warm_pool import pool_workers

    idle_pool = {name for name, status in pool_workers().items() if status["claimant"] is None}
    actors = [
        actor
        for actor in list_actors(
            # This cluster's, by its address: another Ray instance on the machine is not the one to look at.
            address=cluster.dashboard_url,
            filters=[("class_name", "=", worker_class), ("state", "=", "ALIVE")],
        )
        if actor.get("name") not in idle_pool
    ]
    return cluster.node_by_id(sorted(actor["node_id"] for actor in actors if actor["node_id"] != spared)[-1])


def _standby_node(client: RingmasterClient, job_id: str, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready = [e for e in client.events(job_id)["items"] if e["data"] and "standby_node" in e["data"]]
        if ready:
            return ready[0]["data"]["standby_node"]
        time.sleep(0.1)
    raise SystemExit(f"job {job_id} never had a standby worker ready")


def _recovering_event(client: RingmasterClient, job_id: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in client.events(job_id)["items"] if e["to_state"] == "RECOVERING"]
        if found:
            return found[0]
        time.sleep(0.05)
    raise SystemExit(f"job {job_id} never went RECOVERING: {client.job(job_id)}")


def _wait_until_released(client: RingmasterClient, job_id: str, address: str, timeout_s: float = 60) -> None:
    """The next scenario's job must find the whole cluster free, or it is admitted below max."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = list_placement_groups(
            address=address, filters=[("state", "!=", "REMOVED")], raise_on_missing_output=False
        )
        if client.job(job_id)["state"] in ("CANCELLED", "FAILED", "SUCCEEDED") and not held:
            return
        time.sleep(0.2)
    raise SystemExit(f"job {job_id} still holds capacity {timeout_s:.0f}s after its cancel")


def _grown_event(client: RingmasterClient, job_id: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in client.events(job_id)["items"] if "capacity returned" in e["message"]]
        if found:
            return found[0]
        time.sleep(0.05)
    raise SystemExit(f"job {job_id} never grew back to 2 workers: {client.job(job_id)}")


def _newest_step(client: RingmasterClient, job_id: str) -> int:
    return max((row["step"] for row in client.metrics(job_id)["items"]), default=0)


def _first_step_after(client: RingmasterClient, job_id: str, moment: float, timeout_s: float = 300) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        later = [
            row["wall_time"]
            for row in client.metrics(job_id)["items"]
            if row["wall_time"] and row["wall_time"] > moment
        ]
        if later:
            return min(later)
        time.sleep(0.05)
    raise SystemExit(f"job {job_id} did not train again within {timeout_s}s: {client.job(job_id)}")


def _samples_repeated(storage: Path, job_id: str) -> int:
    """Samples the job's effective steps (each step as the newest formation that ran it took it) used more than once
    within an epoch, from the ids its ranks recorded."""
    uses = Counter(
        (epoch, sample) for epoch, ids in read_effective_samples(storage / job_id).values() for sample in ids
    )
    return sum(uses.values()) - len(uses)


def through_ringmaster(cluster: SimulatedCluster, client: RingmasterClient, scenario: str, storage: Path) -> dict:
    if scenario in ("standby", "replace-spare"):
        cluster.add_node()  # the idle capacity the standby starts on, or the warm spare node
    if scenario == "replace-spare":
        # One on each node: the job claims two, one stays idle. Simulated nodes share this machine's cores and a
        # pool worker warms up at the lowest priority, so the spare warms before the job starts, as an idle node
        # on its own CPUs would while the job trains.
        wait_for_warm_pool(len(cluster.cluster.worker_nodes))
    job = client.submit(job_spec(scenario))
    wait_for_step(client, job["id"], KILL_AFTER_STEP, timeout_s=300)
    spared = _standby_node(client, job["id"]) if scenario == "standby" else None
    if scenario in ("replace", "replace-elastic"):
        cluster.add_node()
    victim = _a_worker_node(cluster, spared)
    step_at_kill = _newest_step(client, job["id"])
    struck = time.time()
    if scenario == "frozen":
        cluster.freeze_node(victim)
    else:
        cluster.kill_node(victim)
    try:
        return _recovery(client, scenario, storage, job["id"], struck, step_at_kill, cluster.dashboard_url)
    finally:
        if scenario == "frozen":
            cluster.kill_node(victim)  # a hung node left in the cluster stalls every later add_node (the next round's)


def _recovery(
    client: RingmasterClient,
    scenario: str,
    storage: Path,
    job_id: str,
    struck: float,
    step_at_kill: int,
    address: str,
) -> dict:
    """What one node's loss at `struck` cost the job: measured from its events, metrics and rank records."""
    recovering = _recovering_event(client, job_id)
    # The newest step the old group completed: one in flight at the kill may still have been reported.
    last_before = max(step_at_kill, _newest_step(client, job_id))
    noticed = datetime.fromisoformat(recovering["at"]).timestamp() - struck
    # A step in flight may still end just after the kill; the re-formed group's steps come after RECOVERING.
    trained_again = _first_step_after(client, job_id, max(struck, datetime.fromisoformat(recovering["at"]).timestamp()))
    full_size = {}
    if scenario == "replace-elastic":
        grown = _grown_event(client, job_id)
        full_size["full_size_s"] = round(
            _first_step_after(client, job_id, datetime.fromisoformat(grown["at"]).timestamp()) - struck, 2
        )
    client.cancel(job_id)
    _wait_until_released(client, job_id, address)
    resumed = next(
        e
        for e in client.events(job_id)["items"]
        if e["to_state"] == "RUNNING" and "resumed_from_step" in (e["data"] or {})
    )
    return {
        "recovery_s": round(trained_again - struck, 2),
        "noticed_s": round(noticed, 2),
        **full_size,
        "steps_redone": max(0, last_before - resumed["data"]["resumed_from_step"]),
        "samples_repeated": _samples_repeated(storage, job_id),
        "resumed_from": resumed["data"].get("resumed_from"),
        "world_size_after": resumed["data"].get("world_size"),
        "regroup_s": resumed["data"].get("regroup_s"),
        "standby_workers_used": resumed["data"].get("standby_workers_used"),
    }


def script_job_spec(scenario: str) -> dict:
    """bench/bare_torchrun.py as a script job: tiny-gpt as the managed job trains it, saving every 10 steps to
    RINGMASTER_CHECKPOINT_DIR (as the managed job's checkpoint.every_steps) and resuming from the newest at start."""
    return {
        "name": f"recovery-script-{scenario}",
        "command": [
            "python",
            str(REPO / "bench" / "bare_torchrun.py"),
            "--steps",
            "100000",
            "--global-batch-size",
            "16",
            "--micro-batch-size",
            "4",
            "--checkpoint-every",
            "10",
        ],
        "workers": {"min": 1 if scenario in ("replace-elastic", "shrink") else 2, "max": 2, "cpus_per_worker": 1},
        "max_failures": 3,
        "stop_grace_s": 5,
    }


def _first_row_after(client: RingmasterClient, job_id: str, moment: float, timeout_s: float = 300) -> dict:
    """The metric row of the first step completed after `moment` (a step reported again carries its new wall time:
    the control plane's upsert keeps the newest)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        later = [row for row in client.metrics(job_id)["items"] if row["wall_time"] and row["wall_time"] > moment]
        if later:
            return min(later, key=lambda row: row["wall_time"])
        time.sleep(0.05)
    raise SystemExit(f"job {job_id} did not train again within {timeout_s}s: {client.job(job_id)}")


def through_script_mode(cluster: SimulatedCluster, client: RingmasterClient, scenario: str) -> dict:
    """The same node death under a script-mode job: torchrun's semantics, every process of the group restarted at the
    size the elastic rules choose, the script resuming from its own checkpoint."""
    job = client.submit(script_job_spec(scenario))
    wait_for_step(client, job["id"], KILL_AFTER_STEP, timeout_s=300)
    if scenario in ("replace", "replace-elastic"):
        cluster.add_node()
    victim = _a_worker_node(cluster, worker_class="ScriptWorker")
    step_at_kill = _newest_step(client, job["id"])
    struck = time.time()
    cluster.kill_node(victim)
    recovering = _recovering_event(client, job["id"])
    last_before = max(step_at_kill, _newest_step(client, job["id"]))
    recovering_at = datetime.fromisoformat(recovering["at"]).timestamp()
    # The script reports every step: the restarted group's first is the one after the checkpoint it resumed from.
    first_again = _first_row_after(client, job["id"], max(struck, recovering_at))
    trained_again, resumed_after = first_again["wall_time"], first_again["step"] - 1
    restarted = [e for e in client.events(job["id"])["items"] if e["to_state"] == "RUNNING"][-1]
    client.cancel(job["id"])
    _wait_until_released(client, job["id"], cluster.dashboard_url)
    return {
        "recovery_s": round(trained_again - struck, 2),
        "noticed_s": round(recovering_at - struck, 2),
        "restarted_s": round(datetime.fromisoformat(restarted["at"]).timestamp() - struck, 2),
        "steps_redone": max(0, last_before - resumed_after),
        "resumed_after_step": resumed_after,
        "world_size_after": restarted["data"].get("world_size"),
        "restart_count": restarted["data"].get("restart_count"),
    }


SCRIPT_SCENARIOS = ("replace", "replace-elastic", "shrink")  # a script's group restarts: no standby, spare or freeze


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--skip-ray-train", action="store_true")
    parser.add_argument("--skip-torchft", action="store_true", help="leave out Ray Train with TorchftConfig")
    parser.add_argument(
        "--skip-script", action="store_true", help="leave out the script-mode job (replace, replace-elastic, shrink)"
    )
    parser.add_argument("--warm-workers-per-node", type=int, default=2, help="the cluster's warm pool (0: none)")
    parser.add_argument(
        "--scenarios",
        nargs="+",
        choices=("replace", "replace-elastic", "replace-spare", "standby", "shrink", "frozen"),
        default=["replace", "replace-elastic", "replace-spare", "standby", "shrink", "frozen"],
    )
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {}
    torchft_runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="recovery-") as scratch:
        cluster = SimulatedCluster(nodes=2)
        try:
            with control_plane_on(
                cluster, Path(scratch) / "ringmaster", warm_workers_per_node=args.warm_workers_per_node
            ) as server:
                client = server.client()
                storage = Path(server.plane.settings.resolved_storage_uri())
                watch_cluster(
                    cluster
                )  # this process sees the warm pool's named workers (the control plane's namespace)
                for _ in range(args.rounds):
                    for scenario in args.scenarios:
                        while len(cluster.cluster.worker_nodes) < 2:
                            cluster.add_node()
                        measured = through_ringmaster(cluster, client, scenario, storage)
                        print(json.dumps({"system": "ringmaster", "scenario": scenario, **measured}), flush=True)
                        results.setdefault(scenario, {}).setdefault("ringmaster", []).append(measured["recovery_s"])
                        results[scenario].setdefault("noticed", []).append(measured["noticed_s"])
                        results[scenario].setdefault("ringmaster_steps_redone", []).append(measured["steps_redone"])
                        results[scenario].setdefault("ringmaster_samples_repeated", []).append(
                            measured["samples_repeated"]
                        )
                        if "full_size_s" in measured:
                            results[scenario].setdefault("full_size", []).append(measured["full_size_s"])
                        if scenario in SCRIPT_SCENARIOS and not args.skip_script:
                            while len(cluster.cluster.worker_nodes) < 2:
                                cluster.add_node()
                            script = through_script_mode(cluster, client, scenario)
                            row = {"system": "ringmaster-script", "scenario": scenario, **script}
                            print(json.dumps(row), flush=True)
                            results[scenario].setdefault("script", []).append(script["recovery_s"])
                            results[scenario].setdefault("script_steps_redone", []).append(script["steps_redone"])
                        if scenario == "frozen" or args.skip_ray_train:
                            continue
                        if scenario in ("standby", "replace-spare") and results.get("replace", {}).get("ray_train"):
                            results[scenario]["ray_train"] = results["replace"]["ray_train"]  # the same baseline
                            continue
                        while len(cluster.cluster.worker_nodes) < 2:
                            cluster.add_node()
                        baseline_scenario = "replace" if scenario in ("standby", "replace-spare") else scenario
                        baseline = measure_ray_train(cluster, baseline_scenario, Path(scratch) / "raytrain")
                        print(
                            json.dumps(
                                {
                                    "system": "ray-train",
                                    "scenario": baseline_scenario,
                                    "recovery_s": baseline["recovery_s"],
                                    "steps_redone": baseline["steps_redone"],
                                }
                            ),
                            flush=True,
                        )
                        if baseline["recovery_s"] is not None:
                            results[scenario].setdefault("ray_train", []).append(baseline["recovery_s"])
                            results[scenario].setdefault("ray_train_steps_redone", []).append(baseline["steps_redone"])
                        if scenario == "replace" and not args.skip_torchft:
                            while len(cluster.cluster.worker_nodes) < 2:
                                cluster.add_node()
                            torchft = measure_ray_train(cluster, "replace", Path(scratch) / "torchft", torchft=True)
                            print(
                                json.dumps(
                                    {
                                        "system": "ray-train+torchft",
                                        "scenario": "replace",
                                        **{key: value for key, value in torchft.items() if key != "detail"},
                                        "reason": torchft["detail"].get("reason"),
                                    }
                                ),
                                flush=True,
                            )
                            if torchft["recovery_s"] is not None:
                                torchft_runs.append(torchft)
        finally:
            cluster.shutdown()
    summary = {}
    for scenario, measured in results.items():
        line = {
            name if name.endswith(("_steps_redone", "_samples_repeated")) else f"{name}_s": round(
                statistics.median(values), 2
            )
            for name, values in measured.items()
            if values
        }
        if "ray_train_s" in line:
            line["ratio"] = round(line["ringmaster_s"] / line["ray_train_s"], 3)
            if "script_s" in line:
                line["script_ratio"] = round(line["script_s"] / line["ray_train_s"], 3)
        summary[scenario] = line
    if torchft_runs:
        # torchft's survivor never stops for a replacement, so its pause is what ringmaster's shrink, standby and
        # replace-spare compare with; its replacement's heal is what ringmaster's replace compares with.
        pause = statistics.median(run["recovery_s"] for run in torchft_runs)
        heals = [run["heal_s"] for run in torchft_runs if run["heal_s"] is not None]
        summary["torchft"] = {
            "survivor_pause_s": round(pause, 2),
            "replacement_heal_s": round(statistics.median(heals), 2) if heals else None,
            "steps_redone": max(run["steps_redone"] for run in torchft_runs),
            "samples_repeated": statistics.median(run["samples_repeated"] for run in torchft_runs),
            "samples_never_used": statistics.median(run["samples_never_used"] for run in torchft_runs),
            "of_samples": torchft_runs[0]["detail"]["samples"]["of"],
        }
        for scenario in ("shrink", "standby", "replace-spare", "replace"):
            if "ringmaster_s" in summary.get(scenario, {}):
                against = summary["torchft"]["replacement_heal_s"] if scenario == "replace" else pause
                if against:
                    summary[scenario]["ratio_to_torchft"] = round(summary[scenario]["ringmaster_s"] / against, 3)
    summary["goals"] = {
        "ratio": 0.2,
        "shrink_s": 5.0,
        "frozen_noticed_s": 5.0,
        "ringmaster_steps_redone": 1,
        "shrink_standby_replace_spare_s": 1.0,
        "replace_ratio_to_torchft": 0.2,
        "ringmaster_samples_repeated": 0,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
