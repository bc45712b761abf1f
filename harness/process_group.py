"""Runs a function on N local gloo ranks (torch.multiprocessing), the way a worker group would.

The ranks are forked from a fork server that imported the training stack once (PRELOADED), not started as fresh
interpreters: a fresh one spends seconds of CPU importing torch and torch._dynamo before its first line, and the
suite starts hundreds of ranks. The server is started once per test process, so each rank is given the environment
and working directory of the call that starts it (the server's are those of the first call).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What every rank imports: torch itself, torch._dynamo (which DDP and the optimizers import on first use), and the
# training code under test. Forked children share these pages until they write them.
PRELOADED = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor.parallel",
    "ringmaster.workers.trainer.trainer",
    "ringmaster.workers.strategies",
    "harness.process_group",
]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """Call ``fn(rank, world_size, *args)`` on every rank inside a gloo group; a rank's exception fails the caller."""
    # The group's store listens here, on a port the kernel hands it: a port only found free, then bound by rank 0,
    # was once taken by another process in between (EADDRINUSE in CI).
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True)
    multiprocessing.set_forkserver_preload(PRELOADED)
    mp.start_processes(
        _rank_main,
        args=(fn, world_size, store.port, (dict(os.environ), os.getcwd()), args),
        nprocs=world_size,
        join=True,
        start_method="forkserver",
    )


def _rank_main(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, caller: tuple[dict[str, str], str], args: tuple
) -> None:
    environ, cwd = caller
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
