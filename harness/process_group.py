"""Runs a function on N local gloo ranks (torch.multiprocessing), the way a worker group would."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.ports import free_port


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Call ``fn(rank, world_size, *args)`` on every rank inside a gloo group; a rank's exception fails the caller."""
    mp.spawn(_rank_main, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
