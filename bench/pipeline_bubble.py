"""Pipeline bubble and activation memory of ringmaster's pipeline path, measured per stage.

    python bench/pipeline_bubble.py [--stages 2 4] [--microbatches 2 4 8] [--steps 3] [--forward-ms 50]

Bubble: each (p, m, schedule) runs p gloo ranks through workers.strategies.pipeline (the job path's
own split and schedules). Each stage's busy time is the time spent inside its forward and backward
chunks; idle = 1 − busy / step wall time (the steps start and end at a barrier, so every rank sees
the makespan). It is printed beside the theory, (p−1)/(p+m−1) for GPipe and 1F1B and
(p−1)/(v·m+p−1) for interleaved 1F1B with v stages per rank (goal: within 20%). The theory counts
no communication; every send, receive and schedule step is idle time here, so the ratio grows as
compute per micro-batch shrinks. A stage's compute is emulated by sleeping (--forward-ms forward,
twice that backward, per micro-batch and block), as a GPU's would leave the CPU free: p processes
on a machine with fewer cores would otherwise slow each other and hide the bubble. --compute model
uses real tiny-gpt blocks instead (only meaningful with p ≤ cores). 1F1B and interleaved 1F1B need
m ≥ p (torch refuses fewer micro-batches than stages), so those rows are left out.

Activation memory: with real tiny-gpt stages, the peak bytes autograd holds for backward (parameters
excluded), per stage, for 1F1B beside GPipe; 1F1B keeps at most p − s micro-batches in flight on
stage s where GPipe keeps all m, so the expected ratio is min(p − s, m) / m.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.process_group import run_on_ranks  # noqa: E402
from ringmaster.service.spec import JobSpec  # noqa: E402
from ringmaster.workers.models import ModelBundle, build_bundle  # noqa: E402
from ringmaster.workers.parallel_dims import ParallelDims  # noqa: E402
from ringmaster.workers.strategies import OptimizerConfig, ParallelModel, ParallelSetup, parallelize  # noqa: E402

MICRO_BATCH = 4
MODEL_OPTIONS = {"n_layers": 8, "dim": 128, "n_heads": 4, "seq_len": 64, "max_corpus_bytes": 16_384}


class _Sleep(torch.autograd.Function):
    """Stands for a stage's device compute: busy for a fixed time forward and twice that backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)
        return grad, None


class SleepBlock(nn.Module):
    def __init__(self, forward_s: float) -> None:
        super().__init__()
        self.forward_s = forward_s
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.scale, self.forward_s)


class SleepModel(nn.Module):
    """One sleeping block per stage, in a ModuleDict like tiny-gpt's, so names survive the split."""

    def __init__(self, blocks: int, forward_s: float) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): SleepBlock(forward_s) for i in range(blocks)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x


def sleep_stage(model: SleepModel, stage_index: int, num_stages: int) -> SleepModel:
    stage = SleepModel(0, 0.0)
    stage.layers[str(stage_index)] = model.layers[str(stage_index)]
    return stage


def _spec(p: int, m: int, schedule: str, stages_per_rank: int) -> JobSpec:
    return JobSpec(
        name="bubble",
        model="tiny-gpt",
        model_options=MODEL_OPTIONS,
        strategy="pipeline",
        parallel={"pp": p, "microbatches": m, "schedule": schedule, "stages_per_rank": stages_per_rank},
        workers={"min": p, "max": p},
        train={"global_batch_size": MICRO_BATCH * m, "micro_batch_size": MICRO_BATCH},
    )


def _pipeline(spec: JobSpec, bundle: ModelBundle, world_size: int) -> ParallelModel:
    dims = ParallelDims.from_spec(spec, world_size)
    setup = ParallelSetup(
        spec, dims, dims.build_mesh("cpu"), torch.device("cpu"), OptimizerConfig(lr=1e-3, weight_decay=0.0)
    )
    return parallelize(bundle, setup)


def _batch(spec: JobSpec, compute: str) -> tuple[torch.Tensor, torch.Tensor]:
    size = spec.train.global_batch_size
    if compute == "sleep":
        return torch.ones(size, 1), torch.zeros(size, 1)
    generator = torch.Generator().manual_seed(0)
    seq = MODEL_OPTIONS["seq_len"]
    return torch.randint(0, 256, (size, seq), generator=generator), torch.randint(
        0, 256, (size, seq), generator=generator
    )


def _bundle(spec: JobSpec, compute: str, forward_s: float = 0.0) -> ModelBundle:
    torch.manual_seed(0)
    if compute == "sleep":
        blocks = spec.parallel.pp * (
            spec.parallel.stages_per_rank if spec.parallel.schedule == "interleaved1f1b" else 1
        )
        return ModelBundle(
            SleepModel(blocks, forward_s),
            None,
            None,
            lambda model, batch: F.mse_loss(model(batch[0]), batch[1]),
            pipeline_stage=sleep_stage,
            output_loss_fn=F.mse_loss,
        )
    return build_bundle(spec)


def _step(parallel: ParallelModel, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    first = (inputs,) if parallel.stages[0].is_first else ()
    parallel.schedule.step(*first, target=targets, losses=[])
    for part in parallel.parts:
        part.zero_grad(set_to_none=True)


def _bubble_rank(
    rank: int,
    world_size: int,
    m: int,
    schedule: str,
    stages_per_rank: int,
    compute: str,
    forward_s: float,
    steps: int,
    out: str,
) -> None:
    torch.set_num_threads(1)
    spec = _spec(world_size, m, schedule, stages_per_rank)
    parallel = _pipeline(spec, _bundle(spec, compute, forward_s), world_size)
    busy = [0.0]
    for stage in parallel.stages:
        for method in ("forward_one_chunk", "backward_one_chunk"):
            setattr(stage, method, _timed(getattr(stage, method), busy))
    inputs, targets = _batch(spec, compute)
    _step(parallel, inputs, targets)  # the first step infers shapes between stages
    busy[0], total = 0.0, 0.0
    for _ in range(steps):
        dist.barrier()
        started = time.perf_counter()
        _step(parallel, inputs, targets)
        dist.barrier()
        total += time.perf_counter() - started
    idle = [None] * world_size
    dist.all_gather_object(idle, 1 - busy[0] / total)
    if rank == 0:
        Path(out).write_text(json.dumps(idle))


def _timed(method, busy: list[float]):
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - started

    return timed


class ActivationMeter:
    """Live bytes of the tensors autograd saves for backward, parameters excluded, and their peak."""

    def __init__(self, parameters: list[nn.Parameter]) -> None:
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self.held: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in self.parameter_storages:
            return tensor
        return _Saved(tensor, pointer, self)

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved


class _Saved:
    def __init__(self, tensor: torch.Tensor, pointer: int, meter: ActivationMeter) -> None:
        self.tensor, self.pointer, self.meter = tensor, pointer, meter
        entry = meter.held.setdefault(pointer, [0, tensor.untyped_storage().nbytes()])
        if entry[0] == 0:
            meter.live += entry[1]
            meter.peak = max(meter.peak, meter.live)
        entry[0] += 1

    def __del__(self) -> None:
        entry = self.meter.held[self.pointer]
        entry[0] -= 1
        if entry[0] == 0:
            self.meter.live -= entry[1]
            del self.meter.held[self.pointer]


def _memory_rank(rank: int, world_size: int, m: int, out: str) -> None:
    torch.set_num_threads(1)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        spec = _spec(world_size, m, schedule, 1)
        parallel = _pipeline(spec, _bundle(spec, "model"), world_size)
        inputs, targets = _batch(spec, "model")
        _step(parallel, inputs, targets)
        meter = ActivationMeter([p for part in parallel.parts for p in part.parameters()])
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            _step(parallel, inputs, targets)
        peaks[schedule] = meter.peak
    gathered = [None] * world_size
    dist.all_gather_object(gathered, peaks)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))


def theory(p: int, m: int, stages_per_rank: int) -> float:
    return (p - 1) / (stages_per_rank * m + p - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compute", choices=["sleep", "model"], default="sleep")
    parser.add_argument(
        "--forward-ms", type=float, default=50.0, help="sleep compute: forward time per micro-batch and block"
    )
    args = parser.parse_args()
    out = os.path.join(tempfile.mkdtemp(), "result.json")

    compute = "tiny-gpt compute"
    if args.compute == "sleep":
        compute = f"sleep compute, {args.forward_ms:g} ms forward + {2 * args.forward_ms:g} ms backward"
    print(f"bubble: idle fraction per stage ({compute} per micro-batch and block, {args.steps} timed steps each)")
    print(f"{'p':>2} {'m':>3} {'schedule':<16} {'theory':>7} {'measured (mean)':>16} {'ratio':>6}  per stage")
    for p in args.stages:
        for m in args.microbatches:
            for schedule, per_rank in (("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2)):
                if schedule != "gpipe" and (m < p or m % p):
                    continue
                run_on_ranks(
                    _bubble_rank, p, m, schedule, per_rank, args.compute, args.forward_ms / 1000, args.steps, out
                )
                idle = json.loads(Path(out).read_text())
                expected, mean = theory(p, m, per_rank), sum(idle) / len(idle)
                stages = " ".join(f"{value:.3f}" for value in idle)
                print(
                    f"{p:>2} {m:>3} {schedule:<16} {expected:>7.3f} {mean:>16.3f} {mean / expected:>6.2f}  {stages}",
                    flush=True,
                )

    print("\nactivation memory: peak bytes saved for backward per stage (real tiny-gpt stages), 1F1B vs GPipe")
    print(f"{'p':>2} {'m':>3} {'stage':>5} {'GPipe':>10} {'1F1B':>10} {'ratio':>6} {'expected':>8}")
    for p in args.stages:
        for m in (m for m in args.microbatches if m >= p):
            run_on_ranks(_memory_rank, p, m, out)
            for stage, peaks in enumerate(json.loads(Path(out).read_text())):
                ratio, expected = peaks["1f1b"] / peaks["gpipe"], min(p - stage, m) / m
                print(
                    f"{p:>2} {m:>3} {stage:>5} {peaks['gpipe']:>10} {peaks['1f1b']:>10} {ratio:>6.2f} {expected:>8.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
