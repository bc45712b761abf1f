"""tiny-gpt on one GPU in bf16: tokens/s and peak memory through ringmaster's training loop against a
bare torch loop on the same GPU, model, data and batch.

    python bench/gpu.py             # a CUDA machine; a GPT-2-small-sized tiny-gpt, well under 5 minutes
    python bench/gpu.py --dry-run   # CPU with tiny sizes: runs the whole script, numbers mean nothing

(a) workers.trainer.run_training in a one-rank process group (NCCL), strategy ddp, bf16 autocast,
    the step times it reports as metrics; (b) the same model and AdamW in a plain loop under autocast,
    synchronising once per step as (a) does when it reads the step's loss. Prints steady-state
    tokens/s of each (first --skip-steps left out), their ratio, and the ratio of peak allocated memory; and
    the CPU seconds per step of each over the same steady steps, read the same way for both with bench/cpu_time.py's
    two readings (this process and any below it; the whole machine) at the end of step --skip-steps and at the end
    of the last step (in the bare loop itself, and in (a)'s metric callback, which rank 0 calls as each step ends),
    divided by the steps between.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, RandomSampler

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cpu_time import Cpu, CpuClock  # noqa: E402
from harness.ports import free_port  # noqa: E402
from harness.sinks import CallbackSink  # noqa: E402
from ringmaster.service.reports import MetricPoint  # noqa: E402
from ringmaster.service.spec import JobSpec  # noqa: E402
from ringmaster.workers.models import build_bundle  # noqa: E402
from ringmaster.workers.trainer import TrainContext, run_training  # noqa: E402

GPU_MODEL = {"n_layers": 12, "dim": 768, "n_heads": 12, "seq_len": 512}
DRY_RUN_MODEL = {"n_layers": 2, "dim": 64, "n_heads": 4, "seq_len": 64, "max_corpus_bytes": 262_144}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, few steps")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    if args.dry_run:
        args.steps, args.skip_steps, args.batch_size = 6, 2, 4
    return args


def job_spec(args: argparse.Namespace) -> JobSpec:
    return JobSpec(
        name="gpu-bench",
        model="tiny-gpt",
        model_options=DRY_RUN_MODEL if args.dry_run else GPU_MODEL,
        workers={"min": 1, "max": 1, "gpus_per_worker": 0 if args.dry_run else 1},
        train={
            "steps": args.steps,
            "global_batch_size": args.batch_size,
            "micro_batch_size": args.batch_size,
            "lr": 1e-3,
            "precision": "bf16",
            "seed": 0,
        },
    )


def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def through_ringmaster(
    spec: JobSpec, device: torch.device, skip: int, clock: CpuClock
) -> tuple[float, int | None, Cpu]:
    """Steady step time from the loop's own metrics, the peak memory at the last step, and the machine's CPU
    seconds per steady step."""
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    points: list[MetricPoint] = []
    peak: list[int | None] = [None]
    cpu: dict[int, Cpu] = {}  # step -> the CPU readings as it ended

    def on_metric(point: MetricPoint) -> None:
        if point.loss is not None:
            if point.step in (skip, spec.train.steps):
                cpu[point.step] = clock.read()
            points.append(point)
            if point.step == spec.train.steps:
                peak[0] = peak_memory(device)

    try:
        with tempfile.TemporaryDirectory() as storage:
            run_training(spec, TrainContext(0, 1, device, "gpu-bench", storage, sink=CallbackSink(on_metric=on_metric)))
    finally:
        dist.destroy_process_group()
    cpu_per_step = (cpu[spec.train.steps] - cpu[skip]) / (spec.train.steps - skip)
    return statistics.mean(point.step_time_s for point in points[skip:]), peak[0], cpu_per_step


def bare_loop(spec: JobSpec, device: torch.device, skip: int, clock: CpuClock) -> tuple[float, int | None, Cpu]:
    torch.manual_seed(spec.train.seed)
    bundle = build_bundle(spec)
    model = bundle.model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, weight_decay=spec.train.weight_decay)
    loader = DataLoader(
        bundle.train_dataset,
        batch_size=spec.train.micro_batch_size,
        drop_last=True,
        sampler=RandomSampler(bundle.train_dataset),
        pin_memory=device.type == "cuda",
    )
    batches = iter(loader)
    times = []
    for step in range(spec.train.steps):
        if step == skip:  # step `skip` (counted from 1, as the ringmaster loop's metrics count) has ended
            cpu_start = clock.read()
        started = time.perf_counter()
        inputs, targets = (tensor.to(device, non_blocking=True) for tensor in next(batches))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = bundle.loss_fn(model, (inputs, targets))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # one host sync per step, as the ringmaster loop's loss all-reduce makes
        times.append(time.perf_counter() - started)
    cpu_per_step = (clock.read() - cpu_start) / (spec.train.steps - skip)
    return statistics.mean(times[skip:]), peak_memory(device), cpu_per_step


def main() -> None:
    args = parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU; use --dry-run to exercise it on CPU")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    spec = job_spec(args)
    tokens_per_step = args.batch_size * spec.model_options["seq_len"]
    started = time.perf_counter()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock = CpuClock()
    bare_step, bare_peak, bare_cpu = bare_loop(spec, device, args.skip_steps, clock)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    ringmaster_step, ringmaster_peak, ringmaster_cpu = through_ringmaster(spec, device, args.skip_steps, clock)

    bare_rate, ringmaster_rate = tokens_per_step / bare_step, tokens_per_step / ringmaster_step
    print(
        f"tiny-gpt {spec.model_options} bf16, batch {args.batch_size}, {args.steps} steps ({args.skip_steps} skipped), "
        f"{device}"
    )
    print(
        f"bare torch loop : {bare_rate:12.0f} tokens/s   peak memory {bare_peak}   "
        f"CPU s/step process {bare_cpu.tree:.4f}, machine {bare_cpu.machine:.4f}"
    )
    print(
        f"ringmaster loop : {ringmaster_rate:12.0f} tokens/s   peak memory {ringmaster_peak}   "
        f"CPU s/step process {ringmaster_cpu.tree:.4f}, machine {ringmaster_cpu.machine:.4f}"
    )
    print(
        f"ratio ringmaster/bare: tokens/s {ringmaster_rate / bare_rate:.3f}, CPU s/step process "
        f"{ringmaster_cpu.tree / bare_cpu.tree:.3f}, machine {ringmaster_cpu.machine / bare_cpu.machine:.3f}",
        end="",
    )
    print(
        f", peak memory {ringmaster_peak / bare_peak:.3f}"
        if bare_peak and ringmaster_peak
        else " (no CUDA memory on CPU)"
    )
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
