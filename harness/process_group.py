"""Runs a function on N local gloo ranks (torch.multiprocessing), the way a worker group would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Call ``fn(rank, world_size, *args)`` on every rank inside a gloo group; a rank's exception fails the caller."""
    # The group's store listens here, on a port the kernel hands it: a port only found free, then bound by rank 0,
    # was once taken by another process in between (EADDRINUSE in CI).
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True)
    mp.spawn(_rank_main, args=(fn, world_size, store.port, args), nprocs=world_size, join=True)


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
