"""The training loop's reports and its behaviour on retry, on one in-process rank."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.service.reports import CheckpointRecord, MetricPoint, StoredCheckpoint
from ringmaster.service.spec import JobSpec, parse_spec_text
from ringmaster.workers.checkpoint.durable import checkpoint_metrics, committed_checkpoints
from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.models import ModelBundle
from ringmaster.workers.trainer import TrainContext, run_training

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _context(storage_root: Path, metrics: list[MetricPoint], checkpoints: list[CheckpointRecord]) -> TrainContext:
    return TrainContext(
        0,
        1,
        torch.device("cpu"),
        "job-1",
        str(storage_root),
        sink=CallbackSink(on_metric=metrics.append, on_checkpoint=checkpoints.append),
    )


def test_bf16_run_reports_each_step_warmup_lr_validation_and_final_checkpoint(
    tmp_path: Path, single_rank_group: None
) -> None:
    spec = JobSpec(
        name="bf16",
        model="mlp",
        model_options={"n_train": 256, "n_val": 64},
        train={
            "steps": 4,
            "global_batch_size": 16,
            "micro_batch_size": 8,
            "lr": 0.01,
            "warmup_steps": 2,
            "precision": "bf16",
        },
    )
    metrics, checkpoints = [], []

    result = run_training(spec, _context(tmp_path, metrics, checkpoints))

    step_points = metrics
    assert [p.step for p in step_points] == [1, 2, 3, 4]
    assert [p.lr for p in step_points] == [0.005, 0.01, 0.01, 0.01]
    assert all(
        math.isfinite(p.loss) and p.samples_per_s > 0 and p.step_time_s > 0 and p.world_size == 1 for p in step_points
    )
    # The last step's point waits for the final validation and carries it: a stream that has sent a step's row
    # never sends it again, so a val_loss sent apart, later, would never reach a watcher.
    assert [p.val_loss for p in step_points[:-1]] == [None] * 3
    assert step_points[-1].val_loss == result.val_loss and math.isfinite(result.val_loss)
    [record] = checkpoints
    assert record.model_copy(update={"blocked_s": None, "save_s": None}) == CheckpointRecord(
        step=4,
        uri=str(tmp_path / "step-00000004"),
        world_size=1,
        final=True,
        kept=[StoredCheckpoint(step=4, uri=str(tmp_path / "step-00000004"), world_size=1)],
    )
    assert 0 < record.blocked_s <= record.save_s  # the final save is synchronous: it blocks for all of its time
    assert (result.step, result.loss, result.checkpoint_uri, result.stopped) == (
        4,
        step_points[-1].loss,
        checkpoints[0].uri,
        False,
    )


def test_example_user_model_learns(tmp_path: Path, single_rank_group: None) -> None:
    spec = parse_spec_text((EXAMPLES / "user-model.yaml").read_text())
    spec = spec.model_copy(update={"workers": spec.workers.model_copy(update={"min": 1, "max": 1})})
    metrics: list[MetricPoint] = []

    run_training(spec, _context(tmp_path, metrics, []))

    losses = [p.loss for p in metrics if p.loss is not None]
    assert len(losses) == spec.train.steps
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_retry_of_a_finished_run_does_not_train_again(tmp_path: Path, single_rank_group: None) -> None:
    spec = JobSpec(name="done", model="mlp", model_options={"n_train": 64, "n_val": 16}, train={"steps": 3})
    first = run_training(spec, _context(tmp_path, [], []))
    metrics, checkpoints = [], []

    retried = run_training(spec, _context(tmp_path, metrics, checkpoints))

    assert (retried.step, retried.checkpoint_uri, retried.val_loss) == (3, first.checkpoint_uri, first.val_loss)
    assert checkpoints == [] and [(p.step, p.loss) for p in metrics] == [(3, None)]


def test_a_resumed_attempt_replays_the_metrics_its_checkpoint_kept(tmp_path: Path, single_rank_group: None) -> None:
    """Each checkpoint keeps rank 0's points the control plane has not confirmed storing, naming the attempt that
    ran them: the attempt that resumes from it replays them, in case its predecessor died before they were stored."""
    spec = JobSpec(
        name="replay",
        model="mlp",
        model_options={"n_train": 64, "n_val": 16},
        train={"steps": 8, "global_batch_size": 8, "micro_batch_size": 8},
        checkpoint={"every_steps": 2, "keep": 10},
    )
    first: list[MetricPoint] = []
    calls = itertools.count(1)
    # The driver confirms the first two points once a third exists, then goes quiet (dies, or the control plane is
    # down).
    stopped = run_training(
        spec,
        TrainContext(
            0,
            1,
            torch.device("cpu"),
            "job-1",
            str(tmp_path / "own"),
            sink=CallbackSink(
                on_metric=first.append,
                should_stop=lambda: next(calls) >= 5,
                metrics_confirmed=lambda: 2 if len(first) > 2 else 0,
            ),
            attempt=1,
        ),
    )
    assert (stopped.step, stopped.stopped) == (5, True)

    kept = {checkpoint.step: checkpoint_metrics(checkpoint) for checkpoint in committed_checkpoints(tmp_path / "own")}
    assert {step: [point["step"] for point in points] for step, points in kept.items()} == {
        2: [1, 2],
        4: [3, 4],
        5: [3, 4, 5],
    }
    assert all(point["attempt"] == 1 for points in kept.values() for point in points)

    second: list[MetricPoint] = []
    run_training(
        spec,
        TrainContext(
            0,
            1,
            torch.device("cpu"),
            "job-1",
            str(tmp_path / "own"),
            sink=CallbackSink(on_metric=second.append),
            attempt=2,
        ),
    )
    assert second[:3] == [point.model_copy(update={"attempt": 1}) for point in first[2:5]], (
        "the resumed checkpoint's points, as attempt 1 ran them"
    )
    assert [(point.step, point.attempt) for point in second if point.loss is not None] == [
        (3, 1),
        (4, 1),
        (5, 1),
        (6, None),
        (7, None),
        (8, None),
    ]
    # Nothing of attempt 2's was confirmed: its next save keeps the replayed points too, under attempt 1 still.
    kept_at_6 = checkpoint_metrics(next(c for c in committed_checkpoints(tmp_path / "own") if c.step == 6))
    assert [(point["step"], point["attempt"]) for point in kept_at_6] == [(3, 1), (4, 1), (5, 1), (6, 2)]

    # Another job's checkpoint (resume_from) is a starting point, not this job's history: nothing is replayed.
    other: list[MetricPoint] = []
    run_training(
        spec,
        TrainContext(
            0,
            1,
            torch.device("cpu"),
            "job-2",
            str(tmp_path / "other"),
            sink=CallbackSink(on_metric=other.append),
            resume_from_root=str(tmp_path / "own"),
            attempt=1,
        ),
    )
    assert [point.step for point in other if point.loss is not None] == [], "resumed from a finished run: no step left"


DIVERGES_AT_STEP = 3


def diverging_on_rank_1() -> ModelBundle:
    """A linear model whose loss turns NaN at step DIVERGES_AT_STEP on rank 1 alone (one micro-batch per step), as a
    corrupt sample or an overflow on one rank would make it."""
    calls = itertools.count(1)
    inputs = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        value = nn.functional.mse_loss(model(batch[0]), batch[1])
        return value * math.nan if next(calls) >= DIVERGES_AT_STEP and dist.get_rank() == 1 else value

    return ModelBundle(nn.Linear(4, 1), TensorDataset(inputs, inputs.sum(1, keepdim=True)), None, loss)


def _train_until_the_loss_diverges(rank: int, world_size: int, root: str) -> None:
    spec = JobSpec(
        name="diverges",
        model=f"{__name__}:diverging_on_rank_1",
        data="user",
        train={"steps": 6, "global_batch_size": 8, "micro_batch_size": 4},
        checkpoint={"every_steps": 1, "keep": 10},
    )
    metrics: list[MetricPoint] = []
    try:
        run_training(
            spec,
            TrainContext(
                rank, world_size, torch.device("cpu"), "diverges", root, sink=CallbackSink(on_metric=metrics.append)
            ),
        )
    except JobInputError as error:
        outcome = {"error": error.reason, "steps": [point.step for point in metrics]}
    else:
        outcome = {"error": None}
    Path(root, f"outcome-{rank}.json").write_text(json.dumps(outcome))


def test_a_loss_that_turns_nan_on_one_rank_stops_every_rank_at_that_step_before_it_is_stored(tmp_path: Path) -> None:
    run_on_ranks(_train_until_the_loss_diverges, 2, str(tmp_path))

    outcomes = [json.loads((tmp_path / f"outcome-{rank}.json").read_text()) for rank in range(2)]
    for outcome in outcomes:
        assert outcome["error"] is not None and outcome["error"].startswith(
            f"training diverged: the loss was nan at step {DIVERGES_AT_STEP},"
        ), outcome
    assert outcomes[0]["steps"] == list(range(1, DIVERGES_AT_STEP)), "rank 0 records the finite steps, not the NaN one"
    assert [checkpoint.step for checkpoint in committed_checkpoints(tmp_path)] == list(range(1, DIVERGES_AT_STEP))


def per_sample_losses() -> ModelBundle:
    """A user model whose loss_fn forgot to take the mean."""
    inputs = torch.randn(16, 4)
    return ModelBundle(
        nn.Linear(4, 1),
        TensorDataset(inputs, inputs.sum(1, keepdim=True)),
        None,
        lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1], reduction="none"),
    )


def detached_loss() -> ModelBundle:
    """A user model whose loss_fn hands back a loss autograd no longer tracks."""
    inputs = torch.randn(16, 4)
    return ModelBundle(
        nn.Linear(4, 1),
        TensorDataset(inputs, inputs.sum(1, keepdim=True)),
        None,
        lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1]).detach(),
    )


@pytest.mark.parametrize(
    ("builder", "returned"),
    [
        ("per_sample_losses", "a tensor of shape (4, 1)"),
        (
            "detached_loss",
            "a tensor that autograd does not track (made under torch.no_grad, or with .detach() or .item())",
        ),
    ],
)
def test_a_loss_fn_that_returns_no_trainable_scalar_is_named_as_the_fault(
    tmp_path: Path, single_rank_group: None, builder: str, returned: str
) -> None:
    spec = JobSpec(
        name="bad-loss",
        model=f"{__name__}:{builder}",
        data="user",
        train={"steps": 2, "global_batch_size": 4, "micro_batch_size": 4},
    )
    with pytest.raises(JobInputError) as raised:
        run_training(spec, TrainContext(0, 1, torch.device("cpu"), "bad-loss", str(tmp_path)))
    assert raised.value.reason == (
        f"the model's loss_fn returned {returned}: it must return the batch's mean loss, one "
        "number as a tensor that autograd tracks (for per-sample losses, their .mean()), alone or as (loss, {name: "
        "metric})"
    )
