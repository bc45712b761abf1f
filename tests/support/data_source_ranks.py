"""What each rank runs in tests/workers/data/test_sources.py's multi-rank tests; a module of its own so that the
spawned ranks import only what they need."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import torch

from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec, TokensData
from ringmaster.workers.data.node_cache import node_local_file
from ringmaster.workers.data.sources import data_source_splits
from ringmaster.workers.trainer import TrainContext, run_training

STOP_AFTER = 4


def fetch_on_rank(rank: int, world_size: int, uri: str, out: str) -> None:
    path, fetched = node_local_file(uri)
    train, _ = data_source_splits(TokensData(kind="tokens", path=uri, seq_len=16))
    Path(out, f"rank-{rank}.json").write_text(
        json.dumps({"path": str(path), "fetched": fetched, "last": train[len(train) - 1][1].tolist()})
    )


def token_job(path: Path, num_workers: int, steps: int = 8) -> JobSpec:
    """tiny-gpt on a token file, 2 ranks: 8 steps of 8 windows (2 per micro-step and rank), a checkpoint every 3."""
    return JobSpec.model_validate(
        {
            "name": "tokens",
            "model": "tiny-gpt",
            "model_options": {"n_layers": 1, "dim": 32, "n_heads": 2, "seq_len": 32},
            "data": {
                "kind": "tokens",
                "path": str(path),
                "seq_len": 32,
                "val_fraction": 0.05,
                "num_workers": num_workers,
            },
            "workers": {"min": 2, "max": 2},
            "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "lr": 0.01, "seed": 1},
            "checkpoint": {"every_steps": 3, "keep": 5},
        }
    )


def train_on_ranks(rank: int, world_size: int, path: str, root: str) -> None:
    """The same job read in-process and by 2 DataLoader workers per rank, and stopped and resumed with workers."""
    runs: dict[str, Any] = {}
    for name, num_workers in (("in-process", 0), ("workers", 2)):
        points: list = []
        result = run_training(
            token_job(Path(path), num_workers),
            TrainContext(
                rank,
                world_size,
                torch.device("cpu"),
                name,
                f"{root}/{name}",
                sink=CallbackSink(on_metric=points.append),
            ),
        )
        runs[name] = {"losses": [p.loss for p in points if p.loss is not None], "val_loss": result.val_loss}
    # Stopped after a step while the workers have fetched batches beyond it, then resumed from its checkpoint.
    calls = itertools.count(1)
    stopped = run_training(
        token_job(Path(path), 2),
        TrainContext(
            rank,
            world_size,
            torch.device("cpu"),
            "resumed",
            f"{root}/resumed",
            sink=CallbackSink(should_stop=lambda: next(calls) >= STOP_AFTER),
        ),
    )
    points = []
    run_training(
        token_job(Path(path), 2),
        TrainContext(
            rank,
            world_size,
            torch.device("cpu"),
            "resumed",
            f"{root}/resumed",
            sink=CallbackSink(on_metric=points.append),
        ),
    )
    # The resumed attempt also replays its checkpoint's points of the steps before the stop; what it ran is after it.
    runs["resumed"] = {
        "stopped_at": stopped.step,
        "losses": [p.loss for p in points if p.loss is not None and p.step > STOP_AFTER],
    }
    if rank == 0:
        Path(root, "runs.json").write_text(json.dumps(runs))
