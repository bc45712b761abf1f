"""Under every strategy that shards training state, a run stopped after two steps and resumed from its
checkpoint (each rank reading back only its shards, stages or ZeRO-1 optimizer partition) trains on
exactly like one uninterrupted process."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from harness.checkpoints import latest_committed, load_model_weights
from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec
from ringmaster.workers.models import build_bundle
from ringmaster.workers.trainer import TrainContext, run_training
from tests.support.strategy_reference import strategy_spec, train_reference

WORLD_SIZE = 2
STEPS, STOP_AFTER = 4, 2
CASES = {
    "zero1": ("zero1", 4, {}),
    "fsdp-zero3": ("fsdp", 4, {"shard": "zero3"}),
    "pipeline-interleaved1f1b": ("pipeline", 2, {"pp": 2, "microbatches": 4, "schedule": "interleaved1f1b"}),
    "tensor": ("tensor", 4, {"tp": 2}),
}


def _spec(name: str) -> JobSpec:
    strategy, micro_batch_size, parallel = CASES[name]
    return JobSpec.model_validate(
        strategy_spec(f"resume-{name}", strategy, WORLD_SIZE, STEPS, micro_batch_size, **parallel)
    )


def _stop_then_resume_every_strategy(rank: int, world_size: int, root: str) -> None:
    for name in CASES:
        storage, points = f"{root}/{name}", []
        calls = itertools.count(1)
        stopped = run_training(
            _spec(name),
            TrainContext(
                rank,
                world_size,
                torch.device("cpu"),
                name,
                storage,
                sink=CallbackSink(on_metric=points.append, should_stop=lambda calls=calls: next(calls) >= STOP_AFTER),
            ),
        )
        assert stopped.stopped and stopped.step == STOP_AFTER
        run_training(
            _spec(name),
            TrainContext(
                rank, world_size, torch.device("cpu"), name, storage, sink=CallbackSink(on_metric=points.append)
            ),
        )
        if rank == 0:
            Path(storage, "losses.json").write_text(json.dumps([p.loss for p in points if p.loss is not None]))


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume")
    run_on_ranks(_stop_then_resume_every_strategy, WORLD_SIZE, str(root))
    return root


@pytest.mark.parametrize("name", list(CASES))
def test_stopped_and_resumed_run_matches_uninterrupted_single_process(resumed_runs: Path, name: str) -> None:
    reference = train_reference(STEPS)
    losses = json.loads((resumed_runs / name / "losses.json").read_text())
    assert losses == pytest.approx(reference.losses, abs=1e-5)
    trained = build_bundle(_spec(name)).model
    load_model_weights(latest_committed(resumed_runs / name).path, trained)
    for key, expected in reference.state.items():
        torch.testing.assert_close(
            trained.state_dict()[key], expected, rtol=0, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )
