"""The JobSpec's training knobs reach the trainer: the LR schedule after warmup, the optimizer and its settings, and
validation every few steps; all of them hold across a stop and resume. One in-process rank."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from torch.utils.data import default_collate

from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec, TrainSpec
from ringmaster.workers.data.stream import epoch_order
from ringmaster.workers.models import build_bundle
from ringmaster.workers.trainer import TrainContext, run_training
from ringmaster.workers.trainer.optimizer_step import lr_schedule


def _spec(**train) -> JobSpec:
    return JobSpec(
        name="knobs",
        model="mlp",
        model_options={"n_train": 256, "n_val": 64},
        train={"steps": 8, "global_batch_size": 16, "micro_batch_size": 16, "lr": 0.05, "seed": 4, **train},
    )


def _run(spec: JobSpec, root: Path, **sink) -> list:
    points: list = []
    run_training(
        spec,
        TrainContext(0, 1, torch.device("cpu"), "knobs", str(root), sink=CallbackSink(on_metric=points.append, **sink)),
    )
    return points


def test_cosine_and_linear_decay_after_warmup_as_torchs_own_schedulers_do() -> None:
    """After a linear warmup, the factor follows CosineAnnealingLR / LinearLR from the first step after it, and the
    last step trains at the floor."""
    steps, warmup, floor = 12, 3, 0.1
    decay_steps = steps - warmup - 1
    for kind, scheduler in [
        (
            "cosine",
            lambda optimizer: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=decay_steps, eta_min=floor),
        ),
        ("linear", lambda optimizer: torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, floor, total_iters=decay_steps)),
    ]:
        factor = lr_schedule(
            TrainSpec(steps=steps, warmup_steps=warmup, lr_schedule={"kind": kind, "min_lr_ratio": floor})
        )
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        reference = scheduler(optimizer)
        expected = []
        for _ in range(steps - warmup):
            expected.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            reference.step()
        assert [factor(step) for step in range(warmup)] == [1 / 3, 2 / 3, 1.0]
        assert [factor(step) for step in range(warmup, steps)] == pytest.approx(expected, abs=1e-12), kind
        assert factor(steps - 1) == pytest.approx(floor)
    constant = lr_schedule(TrainSpec(steps=steps, warmup_steps=warmup))
    assert [constant(step) for step in range(steps)] == [1 / 3, 2 / 3] + [1.0] * (steps - 2)


@pytest.mark.parametrize(
    "optimizer",
    [
        {"name": "sgd", "weight_decay": 0.01},
        {"name": "adamw", "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.02},
    ],
)
def test_the_chosen_optimizer_trains_as_plain_torch_does(
    tmp_path: Path, single_rank_group: None, optimizer: dict
) -> None:
    spec = _spec(optimizer=optimizer, lr_schedule={"kind": "linear", "min_lr_ratio": 0.5})
    points = [point for point in _run(spec, tmp_path) if point.loss is not None]

    random.seed(spec.train.seed), np.random.seed(spec.train.seed), torch.manual_seed(spec.train.seed)
    bundle = build_bundle(spec)
    options = {key: value for key, value in optimizer.items() if key != "name"}
    reference = (torch.optim.SGD if optimizer["name"] == "sgd" else torch.optim.AdamW)(
        bundle.model.parameters(), lr=0.05, **options
    )
    factor = lr_schedule(spec.train)
    order = epoch_order(len(bundle.train_dataset), spec.train.seed, 0).tolist()
    losses = []
    for step in range(spec.train.steps):
        batch = default_collate([bundle.train_dataset[i] for i in order[step * 16 : (step + 1) * 16]])
        loss = bundle.loss_fn(bundle.model, batch)
        loss.backward()
        for group in reference.param_groups:
            group["lr"] = 0.05 * factor(step)
        reference.step()
        reference.zero_grad()
        losses.append(loss.item())
    assert [point.lr for point in points] == pytest.approx([0.05 * factor(step) for step in range(8)], abs=1e-15)
    assert [point.loss for point in points] == pytest.approx(losses, abs=1e-6)


def test_a_resumed_run_continues_on_the_schedule_and_validates_every_few_steps(
    tmp_path: Path, single_rank_group: None
) -> None:
    spec = _spec(warmup_steps=2, lr_schedule={"kind": "cosine", "min_lr_ratio": 0.1}, eval_every_steps=3)
    spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"every_steps": 2})})
    straight = _run(spec, tmp_path / "straight")
    calls = itertools.count(1)
    first = _run(spec, tmp_path / "resumed", should_stop=lambda: next(calls) >= 3)
    second = _run(spec, tmp_path / "resumed")

    def steps(points: list) -> list[tuple[int, float, float]]:
        return [
            (point.step, point.lr, point.loss) for point in points if point.loss is not None and point.attempt is None
        ]

    assert [point.step for point in straight if point.val_loss is not None] == [3, 6, 8]
    resumed = steps(first) + steps(second)
    assert [step for step, _, _ in resumed] == list(range(1, 9))
    assert [lr for _, lr, _ in resumed] == [lr for _, lr, _ in steps(straight)]
    assert [loss for _, _, loss in resumed] == pytest.approx([loss for _, _, loss in steps(straight)], abs=1e-6)
    # The resumed run evaluates at its own steps 6 and 8 (the stopped run's step-3 point is replayed, as attempt 1's).
    assert [p.val_loss for p in second if p.val_loss is not None and p.attempt is None] == pytest.approx(
        [p.val_loss for p in straight if p.val_loss is not None and p.step > 3], abs=1e-6
    )


@pytest.mark.parametrize(
    ("train", "field", "message"),
    [
        ({"optimizer": {"name": "lion"}}, ("train", "optimizer", "name"), "'adamw' or 'sgd'"),
        ({"optimizer": {"betas": [0.9, 1.0]}}, ("train", "optimizer", "betas"), "each beta must be in [0, 1)"),
        (
            {"lr_schedule": {"kind": "cosine", "min_lr_ratio": 1.5}},
            ("train", "lr_schedule", "min_lr_ratio"),
            "less than or equal to 1",
        ),
        ({"eval_every_steps": -1}, ("train", "eval_every_steps"), "greater than or equal to 0"),
    ],
)
def test_bad_knobs_name_their_field(train: dict, field: tuple, message: str) -> None:
    with pytest.raises(ValidationError) as raised:
        _spec(**train)
    [error] = raised.value.errors()
    assert error["loc"] == field and message in error["msg"]
