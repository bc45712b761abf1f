"""A plain torchrun DDP script, as a team has one: env:// rendezvous, its own loop, its own checkpoints.

It resumes from its newest checkpoint (after a restart, on fewer workers too), saves on SIGTERM (a cancel), and
reports its loss for ringmaster's curves; under bare torchrun the checkpoints go to ./checkpoints and report() does
nothing.
"""

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ringmaster


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    checkpoints = Path(os.environ.get("RINGMASTER_CHECKPOINT_DIR", "checkpoints"))
    checkpoints.mkdir(parents=True, exist_ok=True)
    latest = checkpoints / "latest.pt"
    step = 0
    if latest.exists():
        state = torch.load(latest, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"] + 1
        print(f"resumed from step {state['step']} on {world} rank(s)", flush=True)

    def save(at_step: int) -> None:
        if rank == 0:  # every rank holds the same state under DDP
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": at_step}
            torch.save(state, checkpoints / "next.pt")
            os.replace(checkpoints / "next.pt", latest)  # a checkpoint is whole or absent

    stopping = []  # a stop (SIGTERM: a cancel, or a restart of the group) asked for: save after this step

    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(8, 1, generator=generator)
    while step < args.steps:
        inputs = torch.randn(32, 8, generator=torch.Generator().manual_seed(step * world + rank)).to(device)
        loss = F.mse_loss(model(inputs), inputs @ weights.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0:
            save(step)
            if rank == 0:
                ringmaster.report(step, loss=loss.item(), lr=args.lr)
                print(f"step {step} loss {loss.item():.4f}", flush=True)
        if stopping:
            save(step)
            sys.exit(0)
        step += 1
    save(args.steps - 1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
