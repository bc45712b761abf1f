"""Measured per-rank training-state memory against the planner's prediction, for every strategy.

    python bench/memory.py [--dim 128] [--layers 4] [--only state|zero3-peak|activations]

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

zero3-peak: a Hugging Face GPT-2 under fsdp zero3 on 2 ranks; during one forward and backward, each rank's unsharded
parameter bytes (FSDP's all-gather outputs still allocated) are sampled at every leaf module's forward and backward
hook. Goal: the peak is at most the rank's shard plus two blocks, not the whole model.

activations: the peak activation memory of one forward and backward (torch's MemTracker) with
train.activation_checkpointing none, selective and full, per block of the same GPT-2.
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

from harness.process_group import run_on_ranks  # noqa: E402
from harness.sinks import CallbackSink  # noqa: E402
from ringmaster.service import planner  # noqa: E402
from ringmaster.service.job_plan import predicted_rank_state  # noqa: E402
from ringmaster.service.spec import JobSpec  # noqa: E402
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
    return JobSpec(
        name="memory",
        model="tiny-gpt",
        model_options=options,
        strategy=strategy,
        parallel=parallel,
        workers={"min": workers, "max": workers},
        train={"steps": 1, "global_batch_size": 16, "micro_batch_size": micro_batch_size},
    )


def _measure(rank: int, world_size: int, spec_json: str, layout: tuple[int, ...] | None, root: str) -> None:
    measured = []
    context = TrainContext(
        rank,
        world_size,
        torch.device("cpu"),
        "memory",
        root,
        sink=CallbackSink(on_memory=measured.append),
        ranks_per_node=layout,
    )
    run_training(JobSpec.model_validate_json(spec_json), context)
    Path(root, f"rank{rank}.json").write_text(measured[0].model_dump_json())


def _predicted(spec: JobSpec, measured: dict, layout: tuple[int, ...] | None) -> planner.StateMemory:
    if spec.parallel.shard == "hybrid" and spec.strategy in ("fsdp", "3d"):
        group = measured["dp"] // len(layout)
        split = planner.Layout(dp=measured["dp"], tp=measured["tp"], pp=measured["pp"], zero=3, shard_group=group)
        return planner.state_memory(measured["parameter_count"], planner.PRECISIONS[spec.train.precision], split)
    return predicted_rank_state(spec, measured["parameter_count"], measured["dp"], measured["tp"], measured["pp"])


def _gpt2_spec(args: argparse.Namespace, workers: int, **train) -> JobSpec:
    options = {
        "vocab_size": 256,
        "n_embd": args.dim,
        "n_layer": args.layers,
        "n_head": 4,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "seq_len": 64,
        "max_corpus_bytes": 65_536,
    }
    return JobSpec(
        name="memory",
        model="hf:GPT2LMHeadModel",
        model_options=options,
        strategy="fsdp",
        parallel={"shard": "zero3"},
        workers={"min": workers, "max": workers},
        train={"steps": 1, "global_batch_size": 8 * workers, "micro_batch_size": 8, **train},
    )


def _unsharded_bytes(fsdp_params: list) -> int:
    return sum(output.untyped_storage().nbytes() for param in fsdp_params for output in param.all_gather_outputs)


def _zero3_peak(rank: int, world_size: int, spec_json: str, root: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    from ringmaster.workers.models import build_bundle
    from ringmaster.workers.parallel_dims import ParallelDims
    from ringmaster.workers.strategies import OptimizerConfig, ParallelSetup, parallelize
    from ringmaster.workers.strategies.blocks import repeated_blocks

    spec = JobSpec.model_validate_json(spec_json)
    bundle = build_bundle(spec)
    blocks = repeated_blocks(bundle.model)
    whole = sum(p.numel() * p.element_size() for p in bundle.model.parameters())
    block_bytes = max(sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks)
    dims = ParallelDims.from_spec(spec, world_size, None)
    setup = ParallelSetup(spec, dims, dims.build_mesh("cpu"), torch.device("cpu"), OptimizerConfig(1e-3, 0.0))
    model = parallelize(bundle, setup).parts[0]
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    fsdp_params = [
        param
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for param in module._get_fsdp_state()._fsdp_param_group.fsdp_params
    ]
    peak = [0]

    def sample(*_) -> None:
        peak[0] = max(peak[0], _unsharded_bytes(fsdp_params))

    for module in model.modules():
        if not list(module.children()):
            module.register_forward_hook(sample)
            module.register_full_backward_pre_hook(sample)
    inputs, targets = next(iter(torch.utils.data.DataLoader(bundle.train_dataset, batch_size=8)))
    bundle.loss_fn(model, (inputs, targets)).backward()
    Path(root, f"rank{rank}.json").write_text(
        json.dumps({"peak": peak[0], "shard": shard, "block": block_bytes, "whole": whole, "blocks": len(blocks)})
    )


def zero3_peak(args: argparse.Namespace) -> None:
    root = tempfile.mkdtemp()
    run_on_ranks(_zero3_peak, 2, _gpt2_spec(args, 2).model_dump_json(), root)
    print(
        f"\nHF GPT-2 (n_embd {args.dim}, {args.layers} blocks), fsdp zero3 on 2 ranks: "
        "unsharded parameter bytes during a step"
    )
    print(
        f"{'rank':>4} {'peak':>10} {'shard':>10} {'one block':>10} {'shard+2 blocks':>15} {'whole model':>12} "
        f"{'peak/whole':>10}"
    )
    for rank in range(2):
        m = json.loads(Path(root, f"rank{rank}.json").read_text())
        bound = m["shard"] + 2 * m["block"]
        print(
            f"{rank:>4} {m['peak']:>10} {m['shard']:>10} {m['block']:>10} {bound:>15} {m['whole']:>12} "
            f"{m['peak'] / m['whole']:>10.3f}  {'ok' if m['peak'] <= bound else 'OVER the goal'}",
            flush=True,
        )


def activations(args: argparse.Namespace) -> None:
    from harness.activation_memory import peak_activation_bytes

    print(
        f"\nHF GPT-2 (n_embd {args.dim}, {args.layers} blocks), batch 8 × 64 tokens: peak activation bytes of one step"
    )
    peaks = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        peaks[mode] = peak_activation_bytes(_gpt2_spec(args, 1), mode)
        print(f"  {mode:<10} {peaks[mode]:>12} bytes  ({peaks[mode] / peaks['none']:.3f} of none)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--only", choices=["state", "zero3-peak", "activations"])
    args = parser.parse_args()
    if args.only in (None, "zero3-peak"):
        zero3_peak(args)
    if args.only in (None, "activations"):
        activations(args)
    if args.only not in (None, "state"):
        return
    print(f"tiny-gpt dim {args.dim}, {args.layers} layers, fp32 AdamW; bytes per rank after the first optimizer step")
    print(
        f"{'strategy':<27} {'rank':>4} {'params':>9} {'grads':>9} {'optim':>9} {'measured':>9} {'predicted':>9} "
        f"{'ratio':>6}"
    )
    for name, (_, workers, layout, _, _) in CASES.items():
        spec = _spec(name, args)
        root = tempfile.mkdtemp()
        run_on_ranks(_measure, workers, spec.model_dump_json(), layout, root)
        for rank in range(workers):
            measured = json.loads(Path(root, f"rank{rank}.json").read_text())
            total = measured["parameters_bytes"] + measured["gradients_bytes"] + measured["optimizer_bytes"]
            predicted = _predicted(spec, measured, layout)
            print(
                f"{name if rank == 0 else '':<27} {rank:>4} {measured['parameters_bytes']:>9} "
                f"{measured['gradients_bytes']:>9} {measured['optimizer_bytes']:>9} {total:>9} "
                f"{round(predicted.total):>9} {total / predicted.total:>6.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
