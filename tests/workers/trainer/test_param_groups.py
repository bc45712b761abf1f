"""train.optimizer.no_decay and .groups: which parameters decay, at what LR, the same under every wrapper and strategy
as in plain torch with the same groups; a group pattern that matches nothing fails the job naming it."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec
from ringmaster.workers.data.stream import epoch_order
from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.models import build_bundle
from ringmaster.workers.strategies.param_groups import GroupRule, param_groups, unwrapped_name
from ringmaster.workers.trainer import TrainContext, run_training
from ringmaster.workers.trainer.optimizer_step import lr_schedule

LR = 0.05
OPTIMIZER = {
    "name": "adamw",
    "weight_decay": 0.5,
    "no_decay": "auto",
    "groups": [{"params": ["hidden_layers.1.*"], "weight_decay": 0.9, "lr_scale": 0.25}],
}


class _OwnNorm(nn.Module):  # a model's own normalization class, found by its name as transformers' Trainer does
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8, 8))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.own_norm = _OwnNorm()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2, bias=False)
        self.head.weight = nn.Parameter(torch.zeros(2, 8))


def _names(model: nn.Module, group: dict) -> set[str]:
    by_id = {id(parameter): name for name, parameter in model.named_parameters()}
    return {by_id[id(parameter)] for parameter in group["params"]}


def test_auto_leaves_biases_norms_and_embeddings_undecayed_and_explicit_groups_come_first() -> None:
    model = _Model()
    rules = [GroupRule(("head.*",), weight_decay=0.3, lr_scale=2.0)]
    groups = param_groups(model, 0.1, "lr_scale", no_decay_auto=True, rules=rules)
    assert [(_names(model, g), g["weight_decay"], g["lr_scale"]) for g in groups] == [
        ({"head.weight"}, 0.3, 2.0),
        ({"proj.weight"}, 0.1, 1.0),
        ({"embed.weight", "norm.weight", "norm.bias", "own_norm.scale", "proj.bias"}, 0.0, 1.0),
    ]
    plain = param_groups(model, 0.1, "lr_scale", no_decay_auto=False, rules=())
    assert len(plain) == 1 and len(plain[0]["params"]) == len(list(model.parameters()))


def test_a_wrappers_segments_are_not_part_of_a_parameters_name() -> None:
    assert unwrapped_name("module.layers.0._checkpoint_wrapped_module._orig_mod.attention.wq.weight") == (
        "layers.0.attention.wq.weight"
    )


def _spec(name: str = "groups", **extra) -> JobSpec:
    return JobSpec(
        name=name,
        model="mlp",
        model_options={"n_train": 256, "n_val": 64},
        train={
            "steps": 6,
            "global_batch_size": 16,
            "micro_batch_size": 8,
            "lr": LR,
            "seed": 4,
            "optimizer": OPTIMIZER,
            "lr_schedule": {"kind": "linear", "min_lr_ratio": 0.5},
        },
        **extra,
    )


def _plain_torch_losses(spec: JobSpec) -> list[float]:
    """The same training with torch.optim.AdamW over hand-made groups."""
    random.seed(spec.train.seed), np.random.seed(spec.train.seed), torch.manual_seed(spec.train.seed)
    bundle = build_bundle(spec)
    named = dict(bundle.model.named_parameters())
    scaled = [named["hidden_layers.1.weight"], named["hidden_layers.1.bias"]]
    decayed = [named["hidden_layers.0.weight"], named["output.weight"]]
    undecayed = [named["hidden_layers.0.bias"], named["output.bias"]]
    optimizer = torch.optim.AdamW(
        [
            {"params": scaled, "weight_decay": 0.9, "scale": 0.25},
            {"params": decayed, "weight_decay": 0.5, "scale": 1.0},
            {"params": undecayed, "weight_decay": 0.0, "scale": 1.0},
        ],
        lr=LR,
    )
    factor = lr_schedule(spec.train)
    order = epoch_order(len(bundle.train_dataset), spec.train.seed, 0).tolist()
    losses = []
    for step in range(spec.train.steps):
        batch = default_collate([bundle.train_dataset[i] for i in order[step * 16 : (step + 1) * 16]])
        loss = bundle.loss_fn(bundle.model, batch)
        loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = LR * factor(step) * group["scale"]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


STRATEGIES = ["ddp", "zero1", "fsdp"]


def _trained_losses(rank: int, world_size: int, root: str, out: str) -> None:
    """Each strategy in turn, in one pair of processes (each spawn costs a torch import)."""
    losses = {}
    for strategy in STRATEGIES:
        spec = _spec(name=f"groups-{strategy}", strategy=strategy, workers={"min": world_size, "max": world_size})
        points: list = []
        sink = CallbackSink(on_metric=points.append)
        run_training(
            spec, TrainContext(rank, world_size, torch.device("cpu"), strategy, f"{root}/{strategy}", sink=sink)
        )
        losses[strategy] = [point.loss for point in points if point.loss is not None]
    if rank == 0:
        torch.save(losses, out)


def test_every_strategy_trains_the_groups_as_plain_torch_does(tmp_path: Path) -> None:
    out = tmp_path / "losses.pt"
    run_on_ranks(_trained_losses, 2, str(tmp_path / "root"), str(out))
    expected = _plain_torch_losses(_spec())
    trained = torch.load(out)
    for strategy in STRATEGIES:
        assert trained[strategy] == pytest.approx(expected, abs=1e-5), strategy


def test_a_group_pattern_matching_no_parameter_fails_the_job_naming_it(tmp_path: Path, single_rank_group) -> None:
    spec = _spec()
    spec.train.optimizer.groups[0].params = ["hidden.*"]
    with pytest.raises(JobInputError) as raised:
        run_training(spec, TrainContext(0, 1, torch.device("cpu"), "groups", str(tmp_path)))
    assert str(raised.value).startswith(
        "train.optimizer.groups[0].params ['hidden.*'] match no trainable parameter of the model, whose parameters "
        "are named like hidden_layers.0.weight, hidden_layers.0.bias, hidden_layers.1.weight, hidden_layers.1.bias, …"
    )
