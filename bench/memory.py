"""Measured per-rank training-state memory against the planner's prediction, for every strategy.

    python bench/memory.py [--dim 128] [--layers 4]

Each strategy trains tiny-gpt for one step on local gloo ranks through the real loop
(workers.trainer.run_training); each rank measures the bytes of its parameters, gradients and
optimizer state from its own tensors after the first optimizer step (what the driver reports).
The prediction is the control plane's own, service.job_plan.predicted_rank_state (the planner's
ZeRO arithmetic: 16 bytes/parameter split by tp × pp and the ZeRO stage's sharding); for hybrid
sharding, which that function leaves out, it is service.planner.state_memory with the node's
shard group. Prints measured/predicted per rank (goal: within 10%).

Where the planner's even split is not what the model does, the ratio shows it: tensor parallelism
splits only the blocks' matrices (embeddings, norms and head stay whole on every tp rank) and the
first and last pipeline stages also hold the embeddings and the head.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ringmaster.service import planner  # noqa: E402
from ringmaster.service.job_plan import predicted_rank_state  # noqa: E402
from ringmaster.service.spec import JobSpec  # noqa: E402
from harness.process_group import run_on_ranks  # noqa: E402
from harness.sinks import CallbackSink
from ringmaster.workers.trainer import TrainContext, run_training  # noqa: E402

# name: (strategy, workers, node layout, micro_batch_size, parallel)
CASES = {
    "ddp": ("ddp", 2, None, 4, {}),
    "zero1": ("zero1", 2, None, 4, {}),
    "fsdp zero2": ("fsdp", 2, None, 4, {"shard": "zero2"}),
    "fsdp zero3": ("fsdp", 2, None, 4, {"shard": "zero3"}),
    "fsdp hybrid 2 nodes x 2": ("fsdp", 4, (2, 2), 2, {"shard": "hybrid"}),
    "pipeline pp2 1f1b": ("pipeline", 2, None, 2, {"pp": 2, "microbatches": 4, "schedule": "1f1b"}),
    "tensor tp2": ("tensor", 2, None, 8, {"tp": 2}),
    "3d dp2 x tp2 (fsdp zero3)": ("3d", 4, None, 4, {"tp": 2}),
    "3d pp2 x tp2": ("3d", 4, None, 2, {"tp": 2, "pp": 2, "microbatches": 4}),
}


def _spec(name: str, args: argparse.Namespace) -> JobSpec:
    strategy, workers, _, micro_batch_size, parallel = CASES[name]
    options = {"n_layers": args.layers, "dim": args.dim, "n_heads": 4, "seq_len": 32, "max_corpus_bytes": 65_536}
    return JobSpec(name="memory", model="tiny-gpt", model_options=options, strategy=strategy, parallel=parallel,
                   workers={"min": workers, "max": workers},
                   train={"steps": 1, "global_batch_size": 16, "micro_batch_size": micro_batch_size})


def _measure(rank: int, world_size: int, spec_json: str, layout: tuple[int, ...] | None, root: str) -> None:
    measured = []
    context = TrainContext(rank, world_size, torch.device("cpu"), "memory", root, sink=CallbackSink(on_memory=measured.append), ranks_per_node=layout)
    run_training(JobSpec.model_validate_json(spec_json), context)
    Path(root, f"rank{rank}.json").write_text(measured[0].model_dump_json())


def _predicted(spec: JobSpec, measured: dict, layout: tuple[int, ...] | None) -> planner.StateMemory:
    if spec.parallel.shard == "hybrid" and spec.strategy in ("fsdp", "3d"):
        group = measured["dp"] // len(layout)
        split = planner.Layout(dp=measured["dp"], tp=measured["tp"], pp=measured["pp"], zero=3, shard_group=group)
        return planner.state_memory(measured["parameter_count"], planner.PRECISIONS[spec.train.precision], split)
    return predicted_rank_state(spec, measured["parameter_count"], measured["dp"], measured["tp"], measured["pp"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print(f"tiny-gpt dim {args.dim}, {args.layers} layers, fp32 AdamW; bytes per rank after the first optimizer step")
    print(f"{'strategy':<27} {'rank':>4} {'params':>9} {'grads':>9} {'optim':>9} {'measured':>9} {'predicted':>9} {'ratio':>6}")
    for name, (_, workers, layout, _, _) in CASES.items():
        spec = _spec(name, args)
        root = tempfile.mkdtemp()
        run_on_ranks(_measure, workers, spec.model_dump_json(), layout, root)
        for rank in range(workers):
            measured = json.loads(Path(root, f"rank{rank}.json").read_text())
            total = measured["parameters_bytes"] + measured["gradients_bytes"] + measured["optimizer_bytes"]
            predicted = _predicted(spec, measured, layout)
            print(f"{name if rank == 0 else '':<27} {rank:>4} {measured['parameters_bytes']:>9} {measured['gradients_bytes']:>9} "
                  f"{measured['optimizer_bytes']:>9} {total:>9} {round(predicted.total):>9} {total / predicted.total:>6.3f}", flush=True)


if __name__ == "__main__":
    main()
