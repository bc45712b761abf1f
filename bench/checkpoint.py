"""Checkpoint cost (issue 4's benchmark; not a timed test): training stall of an asynchronous save vs
the time of a synchronous save of the same state, and restore throughput.

tiny-gpt (dim 256, 6 layers by default) trained with DDP (``--strategy``) on 2 local gloo ranks (one intra-op thread
each), a checkpoint every ``--every`` steps. Each run's rank 0 records the wall time between
consecutive step metrics; a save happens between two metrics, so:

  * sync save time     = interval of a step followed by a synchronous save − the median plain interval
                         (periodic saves forced synchronous by wrapping ``begin_save``);
  * async blocking     = time the training thread spends in an asynchronous ``begin_save`` (state dict,
                         starting the staging copy and the write) plus its wait for the copy before the
                         next optimizer step, vs the synchronous ``begin_save`` (the whole write);
  * async stall        = excess interval of the step holding an asynchronous save, which also pays for
                         the background write competing for the same cores;
  * async in-flight    = mean excess interval of the later steps while the write runs in the background
                         (the write thread competes for the same 2 cores);
  * restore throughput = checkpoint bytes / time of ``load_checkpoint`` (slowest rank) in a resumed run.

    .venv/bin/python bench/checkpoint.py [--dim 256 --layers 6 --steps 24 --every 6]
Prints one JSON object.

With ``--snapshots``, the cost of in-memory snapshots (checkpoint.in_memory) instead, on the same ranks, each taken
for a node (``--world-size``, 2 by default): rounds alternate between snapshots off and on (one buddy copy), side by
side, and compare their median step time (steady state: the first 3 steps left out). The bytes each rank copies into
its own snapshot files per step, those its snapshot takes from the live state instead (ddp's replicated state: read
only after a failure) and those it sends its peers come from the trainer's own report. Rank 0's CPU seconds per step
over the same steps, of its whole process and of its training thread alone, give the snapshots' cost with far less of
the noise of a shared machine's wall clock (its extra CPU with snapshots on, as a share of the step time with them
off: on 2 busy cores, what the step loses). Then a run stopped mid-way is
resumed twice, from peers' memory and from its durable checkpoint of the same step, and their restore throughputs
are compared (the medians of ``--restores`` such runs).

    .venv/bin/python bench/checkpoint.py --snapshots [--rounds 3 --steps 40 --world-size 2 --strategy ddp --restores 3]
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.ports import free_port

METRICS_ACKNOWLEDGED_AFTER_S = 1.0
GLOBAL_BATCH = 16
STEADY_FROM = 3  # --snapshots: steps measured from the end of this one (the first snapshot is a full DCP save)


def _spec(args: argparse.Namespace, steps: int):
    from ringmaster.service.spec import JobSpec

    return JobSpec(
        name="bench-checkpoint",
        model="tiny-gpt",
        strategy=args.strategy,
        parallel={"shard": "zero3"} if args.strategy == "fsdp" else {},
        model_options={
            "n_layers": args.layers,
            "dim": args.dim,
            "n_heads": 8,
            "seq_len": 64,
            "max_corpus_bytes": 262_144,
        },
        workers={"min": args.world_size, "max": args.world_size},
        train={
            "steps": steps,
            "global_batch_size": GLOBAL_BATCH,
            "micro_batch_size": GLOBAL_BATCH // args.world_size,
            "warmup_steps": 2,
            "seed": 1,
        },
        checkpoint={"every_steps": args.every, "keep": 2},
    )


def _rank(rank: int, port: int, args: argparse.Namespace, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    import ringmaster.workers.checkpoint.checkpointer as training
    import ringmaster.workers.checkpoint.durable as checkpoint_module
    from harness.sinks import CallbackSink
    from ringmaster.workers.trainer import TrainContext, run_training

    results: dict = {}
    original_begin, original_load = training.begin_save, training.load_checkpoint

    begin_times: list[float] = []
    original_wait_staged = checkpoint_module.PendingSave.wait_staged

    def timed_begin(*a, synchronous: bool = False, **kw):
        if synchronous:
            kw["process_group"] = None
        started = time.perf_counter()
        pending = original_begin(*a, **kw)
        begin_times.append(time.perf_counter() - started)
        return pending

    def timed_wait_staged(pending):
        # Training also waits here, before the next optimizer step, for a copy staged in the background.
        started = time.perf_counter()
        original_wait_staged(pending)
        begin_times[-1] += time.perf_counter() - started

    checkpoint_module.PendingSave.wait_staged = timed_wait_staged

    for mode in ("sync", "async"):
        begin_times = []
        training.begin_save = functools.partial(timed_begin, synchronous=mode == "sync")
        walls: list[float] = []
        run_training(
            _spec(args, args.steps),
            TrainContext(
                rank,
                args.world_size,
                torch.device("cpu"),
                mode,
                f"{root}/{mode}",
                sink=CallbackSink(
                    on_metric=lambda p, walls=walls: walls.append(time.perf_counter()) if p.loss is not None else None
                ),
            ),
        )
        results[mode] = walls
        results[f"{mode}_begin_s"] = begin_times[:-1]  # periodic saves only (the last is the final, synchronous one)
    training.begin_save = original_begin

    load_times: list[float] = []

    def timed_load(*a, **kw):
        dist.barrier()
        started = time.perf_counter()
        progress = original_load(*a, **kw)
        dist.barrier()
        load_times.append(time.perf_counter() - started)
        return progress

    training.load_checkpoint = timed_load
    # Resumes from the final checkpoint and trains one more step, then saves it (sync: final).
    run_training(
        _spec(args, args.steps + 1),
        TrainContext(rank, args.world_size, torch.device("cpu"), "restore", f"{root}/async"),
    )
    if rank == 0:
        Path(root, "raw.json").write_text(json.dumps({**results, "load_s": load_times}))
    dist.destroy_process_group()


def _summarise(raw: dict, args: argparse.Namespace, root: Path) -> dict:
    every, steps = args.every, args.steps
    saves_after = [s for s in range(every, steps, every)]  # steps followed by a periodic save (1-based)
    summary: dict = {
        "model": f"tiny-gpt dim {args.dim}, {args.layers} layers",
        "world_size": args.world_size,
        "steps": steps,
        "every": every,
    }
    for mode in ("sync", "async"):
        walls = raw[mode]
        intervals = {
            step: walls[step] - walls[step - 1] for step in range(2, len(walls))
        }  # interval ending at metric step+1
        # Interval ending at metric k+1 (index k) contains the save made after step k.
        save_intervals = [intervals[step] for step in saves_after if step in intervals]
        touched = {step + offset for step in saves_after for offset in range(0, every // 2 + 1)}
        plain = [value for step, value in intervals.items() if step not in touched]
        baseline = statistics.median(plain)
        summary[f"{mode}_step_baseline_s"] = round(baseline, 4)
        summary[f"{mode}_save_step_excess_s"] = round(statistics.median(save_intervals) - baseline, 4)
        if mode == "async":
            after = [
                intervals[step + offset] - baseline
                for step in saves_after
                for offset in range(1, every // 2 + 1)
                if step + offset in intervals
            ]
            summary["async_inflight_excess_per_step_s"] = round(statistics.mean(after), 4)
    sync_save = statistics.median(raw["sync_begin_s"])
    blocking = statistics.median(raw["async_begin_s"])
    summary["sync_save_s"] = round(sync_save, 4)
    summary["async_blocking_s"] = round(blocking, 4)
    summary["blocking_over_sync"] = round(blocking / sync_save, 3)
    summary["async_stall_incl_cpu_contention_over_sync"] = round(summary["async_save_step_excess_s"] / sync_save, 3)
    newest = max((root / "async").glob("step-*"))
    size = sum(f.stat().st_size for f in newest.iterdir() if f.is_file())
    load_s = raw["load_s"][0]
    summary.update(
        checkpoint_mb=round(size / 1e6, 1), restore_s=round(load_s, 4), restore_mb_per_s=round(size / 1e6 / load_s, 1)
    )
    return summary


def _snapshot_spec(args: argparse.Namespace, steps: int, snapshots: bool, every_steps: int = 0):
    spec = _spec(args, steps)
    checkpoint = {**spec.checkpoint.model_dump(), "every_steps": every_steps, "in_memory": {"enabled": snapshots}}
    return spec.model_validate({**spec.model_dump(), "checkpoint": checkpoint})


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _snapshot_rank(rank: int, port: int, args: argparse.Namespace, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    from harness.sinks import CallbackSink
    from ringmaster.workers.checkpoint.snapshots.store import SnapshotRef, SnapshotStore
    from ringmaster.workers.trainer import TrainContext, run_training

    store = SnapshotStore()
    one_per_node = (1,) * args.world_size  # as the trainer is told: snapshots go to the next "node"

    def train(
        job: str,
        spec,
        stop_after: int | None = None,
        resume: SnapshotRef | None = None,
        generation: int = 1,
        storage: str | None = None,
    ):
        walls, events, recorded, cpu = [], [], [], []
        calls = iter(range(1, 10**9))

        def on_metric(point) -> None:
            recorded.append(time.perf_counter())
            if point.loss is not None:
                walls.append(recorded[-1])
                cpu.append(
                    (_cpu_s(resource.RUSAGE_SELF), _cpu_s(resource.RUSAGE_THREAD))
                )  # called on the training thread

        # As the driver does: rank 0's points are acknowledged about a second after they are recorded (it drains
        # them every second), so a snapshot keeps the last second's points, not all of them.
        sink = CallbackSink(
            on_metric=on_metric,
            on_event=lambda message, details: events.append(details),
            should_stop=(lambda: next(calls) >= stop_after) if stop_after else (lambda: False),
            metrics_confirmed=lambda: bisect.bisect(recorded, time.perf_counter() - METRICS_ACKNOWLEDGED_AFTER_S),
        )
        run_training(
            spec,
            TrainContext(
                rank,
                args.world_size,
                torch.device("cpu"),
                job,
                f"{root}/{storage or job}",
                sink=sink,
                ranks_per_node=one_per_node,
                generation=generation,
                snapshot_store=store,
                resume_snapshot=resume,
            ),
        )
        return walls, events, cpu

    results: dict = {"off": [], "on": [], "costs": [], "cpu_off": [], "cpu_on": []}
    for index in range(args.rounds):
        for mode in ("off", "on"):
            walls, events, cpu = train(f"{mode}-{index}", _snapshot_spec(args, args.steps, snapshots=mode == "on"))
            if rank == 0:  # the rank that records metric points
                intervals = [b - a for a, b in zip(walls[STEADY_FROM:], walls[STEADY_FROM + 1 :])]
                results[mode].append(statistics.median(intervals))
                # CPU seconds per step over the same steps: the process (every thread: the snapshot thread, gloo's
                # I/O threads) and the training thread alone
                steps = len(cpu) - 1 - STEADY_FROM
                results[f"cpu_{mode}"].append([(end - start) / steps for start, end in zip(cpu[STEADY_FROM], cpu[-1])])
            results["costs"] += [e["snapshot_host_memory"] for e in events if "snapshot_host_memory" in e]
    # Each time: a run stopped after step `half` with a durable checkpoint of that step, then resumed both ways.
    half = args.steps // 2
    for index in range(args.restores):
        job = f"resume-{index}"
        train(job, _snapshot_spec(args, args.steps, snapshots=True, every_steps=half), stop_after=half)
        # The memory run writes its own final checkpoint elsewhere: the storage run must find step `half` the newest.
        for source, resume, storage in (("memory", SnapshotRef(1, half), f"{job}-memory"), ("storage", None, None)):
            _, events, _ = train(
                job,
                _snapshot_spec(args, half + 1, snapshots=source == "memory"),
                resume=resume,
                generation=2,
                storage=storage,
            )
            results.setdefault(f"restore_{source}", []).extend(e for e in events if "restored_step" in e)
    if rank == 0:
        Path(root, "raw.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _snapshot_cpu(raw: dict, step_s: float) -> dict:
    summary = {}
    for index, part in enumerate(("process", "training_thread")):
        off = statistics.median(cpu[index] for cpu in raw["cpu_off"])
        on = statistics.median(cpu[index] for cpu in raw["cpu_on"])
        summary[f"cpu_s_per_step_{part}"] = {"off": round(off, 4), "on": round(on, 4)}
        summary[f"snapshot_cpu_{part}_percent_of_step"] = round(100 * (on - off) / step_s, 1)
    return summary


def _summarise_snapshots(raw: dict, args: argparse.Namespace) -> dict:
    off, on = statistics.median(raw["off"]), statistics.median(raw["on"])
    [costs] = raw["costs"][:1]
    memory, storage = raw["restore_memory"], raw["restore_storage"]
    memory_s = statistics.median(event["restore_s"] for event in memory)
    storage_s = statistics.median(event["restore_s"] for event in storage)
    snapshot_bytes = sum(cost["own_bytes_per_snapshot"] for cost in costs)
    return {
        "model": f"tiny-gpt dim {args.dim}, {args.layers} layers",
        "strategy": args.strategy,
        "world_size": args.world_size,
        "rounds": args.rounds,
        "step_s_snapshots_off": [round(value, 4) for value in raw["off"]],
        "step_s_snapshots_on": [round(value, 4) for value in raw["on"]],
        "step_time_on_over_off": round(on / off, 3),
        "overhead_percent": round(100 * (on / off - 1), 1),
        # each round's on over the off run just before it (the machine's load drifts between rounds)
        "round_ratios": [round(b / a, 3) for a, b in zip(raw["off"], raw["on"], strict=True)],
        # Rank 0's CPU per step, which the machine's slow spells change far less than the wall clock: the process's
        # extra with snapshots on is what the snapshots cost it (their copies, the gloo I/O of their exchange), the
        # training thread's extra the part it does itself. Each as a share of the step time with snapshots off.
        **_snapshot_cpu(raw, off),
        # ddp's snapshot of its replicated state is the live state itself (made into a file only when read)
        "bytes_copied_per_step": {
            cost["rank"]: cost["own_bytes_per_snapshot"] - cost["live_bytes_per_snapshot"] for cost in costs
        },
        "bytes_kept_live_per_step": {cost["rank"]: cost["live_bytes_per_snapshot"] for cost in costs},
        "bytes_sent_to_peers_per_step": {cost["rank"]: cost["sent_bytes_per_snapshot"] for cost in costs},
        "host_bytes_held_per_rank": {cost["rank"]: cost["held_bytes"] for cost in costs},
        "full_dcp_saves_in_first_two_snapshots": {cost["rank"]: cost["full_saves"] for cost in costs},
        # medians over --restores pairs, each in its own list
        "restore_from_memory_s": round(memory_s, 4),
        "restore_from_storage_s": round(storage_s, 4),
        "restores_from_memory_s": [event["restore_s"] for event in memory],
        "restores_from_storage_s": [event["restore_s"] for event in storage],
        "memory_storage_reads": sum(event["storage_reads"] for event in memory),
        "restored_steps": sorted({event["restored_step"] for event in memory + storage}),
        "snapshot_mb": round(snapshot_bytes / 1e6, 2),
        "memory_restore_mb_per_s": round(snapshot_bytes / 1e6 / memory_s, 1),
        "storage_restore_mb_per_s": round(snapshot_bytes / 1e6 / storage_s, 1),
        "memory_over_storage_throughput": round(storage_s / memory_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=6)
    parser.add_argument("--snapshots", action="store_true", help="measure in-memory snapshots instead")
    parser.add_argument("--rounds", type=int, default=3, help="--snapshots: rounds of off and on")
    parser.add_argument(
        "--restores",
        type=int,
        default=3,
        help="--snapshots: runs stopped mid-way and resumed both ways (their medians are printed)",
    )
    parser.add_argument(
        "--strategy",
        choices=("ddp", "zero1", "fsdp"),
        default="ddp",
        help="ddp (its replicated state is snapshotted live), zero1 or fsdp zero3 (shards copied to a buddy)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=2,
        choices=(2, 4, 8, 16),
        help="ranks (local gloo processes; with --snapshots, one per node)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        rank_main = _snapshot_rank if args.snapshots else _rank
        mp.spawn(rank_main, args=(free_port(), args, root), nprocs=args.world_size, join=True)
        raw = json.loads(Path(root, "raw.json").read_text())
        summary = _summarise_snapshots(raw, args) if args.snapshots else _summarise(raw, args, Path(root))
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
