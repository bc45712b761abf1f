"""Checkpoint cost (issue 4's benchmark; not a timed test): training stall of an asynchronous save vs
the time of a synchronous save of the same state, and restore throughput.

tiny-gpt (dim 256, 6 layers by default) trained with DDP on 2 local gloo ranks (one intra-op thread
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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.ports import free_port  # noqa: E402

WORLD_SIZE = 2


def _spec(args: argparse.Namespace, steps: int):
    from ringmaster.service.spec import JobSpec

    return JobSpec(
        name="bench-checkpoint",
        model="tiny-gpt",
        model_options={"n_layers": args.layers, "dim": args.dim, "n_heads": 8, "seq_len": 64, "max_corpus_bytes": 262_144},
        workers={"min": WORLD_SIZE, "max": WORLD_SIZE},
        train={"steps": steps, "global_batch_size": 16, "micro_batch_size": 8, "warmup_steps": 2, "seed": 1},
        checkpoint={"every_steps": args.every, "keep": 2},
    )


def _rank(rank: int, port: int, args: argparse.Namespace, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    import ringmaster.workers.checkpoint as checkpoint_module
    import ringmaster.workers.trainer.checkpointer as training
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
        training.begin_save = lambda *a, **kw: timed_begin(*a, synchronous=mode == "sync", **kw)
        walls: list[float] = []
        run_training(_spec(args, args.steps), TrainContext(rank, WORLD_SIZE, torch.device("cpu"), mode, f"{root}/{mode}", sink=CallbackSink(on_metric=lambda p: walls.append(time.perf_counter()) if p.loss is not None else None)))
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
    run_training(_spec(args, args.steps + 1), TrainContext(rank, WORLD_SIZE, torch.device("cpu"), "restore", f"{root}/async"))
    if rank == 0:
        Path(root, "raw.json").write_text(json.dumps({**results, "load_s": load_times}))
    dist.destroy_process_group()


def _summarise(raw: dict, args: argparse.Namespace, root: Path) -> dict:
    every, steps = args.every, args.steps
    saves_after = [s for s in range(every, steps, every)]  # steps followed by a periodic save (1-based)
    summary: dict = {"model": f"tiny-gpt dim {args.dim}, {args.layers} layers", "world_size": WORLD_SIZE, "steps": steps, "every": every}
    for mode in ("sync", "async"):
        walls = raw[mode]
        intervals = {step: walls[step] - walls[step - 1] for step in range(2, len(walls))}  # interval ending at metric step+1
        # Interval ending at metric k+1 (index k) contains the save made after step k.
        save_intervals = [intervals[step] for step in saves_after if step in intervals]
        touched = {step + offset for step in saves_after for offset in range(0, every // 2 + 1)}
        plain = [value for step, value in intervals.items() if step not in touched]
        baseline = statistics.median(plain)
        summary[f"{mode}_step_baseline_s"] = round(baseline, 4)
        summary[f"{mode}_save_step_excess_s"] = round(statistics.median(save_intervals) - baseline, 4)
        if mode == "async":
            after = [intervals[step + offset] - baseline for step in saves_after for offset in range(1, every // 2 + 1) if step + offset in intervals]
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
    summary.update(checkpoint_mb=round(size / 1e6, 1), restore_s=round(load_s, 4), restore_mb_per_s=round(size / 1e6 / load_s, 1))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        mp.spawn(_rank, args=(free_port(), args, root), nprocs=WORLD_SIZE, join=True)
        raw = json.loads(Path(root, "raw.json").read_text())
        print(json.dumps(_summarise(raw, args, Path(root)), indent=2))


if __name__ == "__main__":
    main()
