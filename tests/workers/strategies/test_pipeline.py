"""GPipe, 1F1B and interleaved 1F1B give the unsplit model's gradients: every stage parameter's gradient
at every optimizer step, through the real training loop with two accumulated schedule steps per update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from harness.process_group import run_on_ranks
from ringmaster.service.spec import JobSpec
from ringmaster.workers.models import build_bundle
from ringmaster.workers.models.tiny_gpt_parallelize import pipeline_stage
from ringmaster.workers.trainer import TrainContext, run_training
from tests.support.strategy_reference import strategy_spec, train_reference

WORLD_SIZE = 2
STEPS = 2
# micro_batch_size 2 × 4 micro-batches = 8 samples per schedule step: two schedule steps per global batch of 16.
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved1f1b": 2}  # schedule: stages per rank


def _spec(schedule: str) -> JobSpec:
    return JobSpec.model_validate(
        strategy_spec(
            f"grads-{schedule}",
            "pipeline",
            WORLD_SIZE,
            STEPS,
            2,
            pp=WORLD_SIZE,
            microbatches=4,
            schedule=schedule,
            stages_per_rank=SCHEDULES[schedule],
        )
    )


def _record_stage_gradients(rank: int, world_size: int, root: str) -> None:
    """Runs on each rank: per schedule, the gradient of every parameter of this rank's stages at each step, by name."""
    calls: list[list[torch.Tensor]] = []
    hook = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: calls.append(
            [p.grad.clone() for group in optimizer.param_groups for p in group["params"]]
        )
    )
    try:
        for schedule, stages_per_rank in SCHEDULES.items():
            calls.clear()
            spec = _spec(schedule)
            run_training(spec, TrainContext(rank, world_size, torch.device("cpu"), "grads", f"{root}/{schedule}"))
            # One optimizer per stage, in the order of this rank's stage indices (looped: rank, rank + pp, ...).
            num_stages = world_size * stages_per_rank
            stage_names = [
                [
                    name
                    for name, _ in pipeline_stage(
                        build_bundle(spec).model, rank + virtual * world_size, num_stages
                    ).named_parameters()
                ]
                for virtual in range(stages_per_rank)
            ]
            by_step = [{} for _ in range(STEPS)]
            for call, gradients in enumerate(calls):
                by_step[call // stages_per_rank].update(
                    zip(stage_names[call % stages_per_rank], gradients, strict=True)
                )
            torch.save(by_step, f"{root}/{schedule}/rank{rank}.pt")
    finally:
        hook.remove()


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pipeline")
    run_on_ranks(_record_stage_gradients, WORLD_SIZE, str(root))
    return root


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pipeline_schedule_gives_the_unsplit_model_gradients(pipeline_runs: Path, schedule: str) -> None:
    reference = train_reference(STEPS)
    per_rank = [torch.load(pipeline_runs / schedule / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    for step in range(STEPS):
        gradients = {name: grad for rank_steps in per_rank for name, grad in rank_steps[step].items()}
        assert sorted(gradients) == sorted(reference.gradients[step]), "the stages together hold every parameter once"
        for name, expected in reference.gradients[step].items():
            torch.testing.assert_close(
                gradients[name],
                expected,
                rtol=1e-4,
                atol=1e-6,
                msg=lambda m, step=step, name=name: f"step {step + 1} {name}: {m}",
            )
