"""Baseline: tiny-gpt (or, with --model hf-gpt2, a Hugging Face GPT-2) trained by a hand-written DDP loop under
torchrun, with no ringmaster in the way.

    torchrun --nproc_per_node=N bench/bare_torchrun.py --steps S --global-batch-size G --micro-batch-size M --seed 0
                                                       [--model hf-gpt2] [--report-every 1] [--checkpoint-every K]

Prints one JSON line whose steps_per_s_steady ringmaster's overhead is measured against, the wall-clock span of the
steady steps (steady_wall), the end of this process's first step (first_step_wall) and rank 0's own CPU seconds per
steady step (rank0_cpu_s_per_step: its process alone, every thread).

It is also the script bench/overhead.py --script and bench/recovery.py run through ringmaster's script mode, unchanged
(a torchrun script: env:// rendezvous, its own loop): rank 0 reports its loss with `ringmaster.report` every
--report-every steps (step numbers count the steps done, from 1, as a managed job's metrics do), which does nothing
under bare torchrun; with --checkpoint-every K rank 0 saves the model, optimizer and step every K steps to
$RINGMASTER_CHECKPOINT_DIR (./checkpoints outside ringmaster), and every rank resumes from the newest at start, as a
script restarted by torchrun's elastic semantics does (its data order starts again: the bench times recovery, not
what the steps learn).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import ringmaster
from ringmaster.workers.data.pysource import pysource_splits
from ringmaster.workers.models.tiny_gpt import TinyGPT, TinyGPTConfig

# hf-gpt2: the model_options of ringmaster's `model: hf:GPT2LMHeadModel` in bench/overhead.py, and this script's GPT-2
HF_GPT2_OPTIONS = {
    "vocab_size": 256,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 64,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
SEQ_LEN = 64  # tiny-gpt's default, and GPT-2's n_positions above


def build_model(name: str) -> torch.nn.Module:
    if name == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        # Without the generation cache, as ringmaster trains every transformers model (workers/models/hf.py).
        return GPT2LMHeadModel(GPT2Config(**HF_GPT2_OPTIONS, use_cache=False))
    return TinyGPT(TinyGPTConfig())


def logits(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny-gpt", "hf-gpt2"], default="tiny-gpt")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--skip-steps", type=int, default=5, help="Warm-up steps left out of the steady-state rate.")
    parser.add_argument(
        "--report-every", type=int, default=1, help="ringmaster.report(step, loss) this often on rank 0 (0: never)."
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="Save every K steps and resume from the newest (0: never)."
    )
    return parser.parse_args()


def micro_batches(
    dataset: Dataset, sampler: DistributedSampler, batch_size: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless micro-batches of this rank's shard; a new shuffle each epoch."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for inputs, targets in DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True):
            yield inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        epoch += 1


def save(checkpoints: Path, model: DistributedDataParallel, optimizer: torch.optim.Optimizer, done: int) -> None:
    """A checkpoint is whole or absent: written aside, then renamed over the newest."""
    checkpoints.mkdir(parents=True, exist_ok=True)
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": done}
    torch.save(state, checkpoints / "next.pt")
    os.replace(checkpoints / "next.pt", checkpoints / "latest.pt")


def resume(
    checkpoints: Path, model: DistributedDataParallel, optimizer: torch.optim.Optimizer, device: torch.device
) -> int:
    """The steps done by the newest checkpoint, loaded into the model and optimizer; 0 without one."""
    latest = checkpoints / "latest.pt"
    if not latest.exists():
        return 0
    state = torch.load(latest, map_location=device)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    print(f"resumed after step {state['step']} on {dist.get_world_size()} rank(s)", flush=True)
    return int(state["step"])


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    if args.global_batch_size % (args.micro_batch_size * world_size) or args.steps <= args.skip_steps:
        raise SystemExit(
            "global batch must be a multiple of micro batch × world size, and --steps must exceed --skip-steps"
        )
    accumulation = args.global_batch_size // (args.micro_batch_size * world_size)

    torch.manual_seed(args.seed)
    model = DistributedDataParallel(build_model(args.model).to(device), device_ids=[device] if use_cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_dataset, _ = pysource_splits(seq_len=SEQ_LEN)
    sampler = DistributedSampler(
        train_dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
    )
    batches = micro_batches(train_dataset, sampler, args.micro_batch_size, device)
    checkpoints = Path(os.environ.get("RINGMASTER_CHECKPOINT_DIR", "checkpoints"))
    start = resume(checkpoints, model, optimizer, device) if args.checkpoint_every else 0

    loss_sum = torch.zeros((), device=device)
    steady_start, steady_wall_start, steady_cpu_start = time.perf_counter(), time.time(), time.process_time()
    first_step_wall = None
    for step in range(start, args.steps):
        if step == start + args.skip_steps:
            steady_start, steady_wall_start, steady_cpu_start = time.perf_counter(), time.time(), time.process_time()
        loss_sum.zero_()
        for micro_step in range(accumulation):
            inputs, targets = next(batches)
            with model.no_sync() if micro_step < accumulation - 1 else nullcontext():
                loss = F.cross_entropy(logits(model(inputs)).flatten(0, 1), targets.flatten())
                (loss / accumulation).backward()
            loss_sum += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        global_loss = loss_sum.item() / (accumulation * world_size)
        done = step + 1
        if first_step_wall is None:
            first_step_wall = time.time()
        if rank == 0 and args.report_every and done % args.report_every == 0:
            ringmaster.report(done, loss=global_loss)
        if rank == 0 and args.checkpoint_every and done % args.checkpoint_every == 0:
            save(checkpoints, model, optimizer, done)
    steady_seconds, steady_wall_end = time.perf_counter() - steady_start, time.time()
    steady_cpu = time.process_time() - steady_cpu_start  # this process's own, every thread (gloo's) included

    if rank == 0:
        steady_steps = args.steps - start - args.skip_steps
        # The steady steps' wall-clock span (Unix time, as ringmaster's metrics give wall_time), for bench/overhead.py's
        # CPU figure.
        report = {
            "steps_per_s_steady": steady_steps / steady_seconds,
            "steady_wall": [steady_wall_start, steady_wall_end],
            "first_step_wall": first_step_wall,
            "rank0_cpu_s_per_step": steady_cpu / steady_steps,
            "resumed_from_step": start,
            "steps": args.steps,
            "world_size": world_size,
            "final_loss": global_loss,
        }
        print(json.dumps(report), flush=True)
    dist.barrier()  # no rank tears the group down while a peer is still in a collective (seen: an abort at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
