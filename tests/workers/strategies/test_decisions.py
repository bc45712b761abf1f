"""The composition says what it decided: the blocks it found and where, the FSDP units, each pipeline stage's
modules, the tensor-parallel plan's source, activation checkpointing and compile, in one event from rank 0."""

from __future__ import annotations

from pathlib import Path

import torch

from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec
from ringmaster.workers.trainer import TrainContext, run_training
from tests.support.strategy_reference import strategy_spec

CASES = {
    "fsdp": strategy_spec("decided-fsdp", "fsdp", 2, 2, 4, shard="zero2"),
    "pipeline": strategy_spec("decided-pipeline", "pipeline", 2, 2, 2, pp=2, microbatches=4, schedule="1f1b"),
    "tensor": {
        **strategy_spec("decided-tensor", "tensor", 2, 2, 4, tp=2),
        "train": {**strategy_spec("t", "tensor", 2, 2, 4)["train"], "activation_checkpointing": "full"},
    },
}


def _decisions_of_each(rank: int, world_size: int, root: str, out: str) -> None:
    """Two steps (the warmup's) of each case in one pair of processes; rank 0 keeps the events it was given."""
    seen: dict[str, list] = {}
    for name, document in CASES.items():
        events: list = []
        sink = CallbackSink(on_event=lambda message, details, events=events: events.append((message, details)))
        context = TrainContext(rank, world_size, torch.device("cpu"), name, f"{root}/{name}", sink=sink)
        run_training(JobSpec.model_validate(document), context)
        seen[name] = [event for event in events if "parallel_layout" in event[1]]
    if rank == 0:
        torch.save(seen, out)
    else:
        assert all(not events for events in seen.values()), "only rank 0 reports the decisions"


def test_rank_0_reports_the_layout_each_strategy_chose(tmp_path: Path) -> None:
    out = tmp_path / "decisions.pt"
    run_on_ranks(_decisions_of_each, 2, str(tmp_path / "root"), str(out))
    seen = torch.load(out)

    [(message, details)] = seen["fsdp"]
    layout = details["parallel_layout"]
    assert layout["blocks"] == "4 × TransformerBlock at layers (from the largest container of same-class modules)"
    assert layout["fsdp_units"] == "4 × TransformerBlock at layers, and the root (zero2)"
    assert layout["activation_checkpointing"] == "none" and layout["compile"] == "none"
    assert message.startswith("parallelized: blocks 4 × TransformerBlock at layers")

    [(_, details)] = seen["pipeline"]
    assert details["parallel_layout"]["pipeline_stages"] == [
        "stage 0 (pp rank 0): tok_embeddings, pos_embeddings, layers.0, layers.1",
        "stage 1 (pp rank 1): layers.2, layers.3, norm, output",
    ]
    assert "fsdp_units" not in details["parallel_layout"]

    [(_, details)] = seen["tensor"]
    layout = details["parallel_layout"]
    assert layout["tensor_parallel"].startswith("tp = 2, plan from ringmaster.workers.models."), layout
    assert layout["activation_checkpointing"] == "full: 4 × TransformerBlock at layers"
