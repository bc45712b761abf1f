"""Gradient clipping at the global norm one process computes, under every way of splitting the model; the blocks
FSDP, activation checkpointing and compile work on, found wherever they sit; and what checkpointing and compile do to
the numbers (nothing, and nearly nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from harness.activation_memory import peak_activation_bytes
from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec
from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.strategies.blocks import repeated_blocks
from ringmaster.workers.trainer import TrainContext, run_training
from tests.support.strategy_reference import GLOBAL_BATCH, strategy_spec, train_reference

STEPS = 4
GRAD_CLIP = 0.5  # below the reference's norms, so every step is clipped
CASES = {
    "ddp": ("ddp", 8, {}),
    "fsdp-zero3": ("fsdp", 8, {"shard": "zero3"}),
    "tensor": ("tensor", 8, {"tp": 2}),
    "pipeline-1f1b": ("pipeline", 2, {"pp": 2, "microbatches": 4}),
}


def _clipped_runs(rank: int, world_size: int, root: str) -> None:
    for name, (strategy, micro_batch_size, parallel) in CASES.items():
        spec = JobSpec.model_validate(
            strategy_spec(
                f"clip-{name}", strategy, world_size, STEPS, micro_batch_size, grad_clip=GRAD_CLIP, **parallel
            )
        )
        points: list = []
        run_training(
            spec,
            TrainContext(
                rank,
                world_size,
                torch.device("cpu"),
                name,
                f"{root}/{name}",
                sink=CallbackSink(on_metric=points.append),
            ),
        )
        if rank == 0:
            Path(root, f"{name}.json").write_text(
                json.dumps([(point.loss, point.grad_norm) for point in points if point.loss is not None])
            )


@pytest.fixture(scope="module")
def clipped_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clip")
    run_on_ranks(_clipped_runs, 2, str(root))
    return root


@pytest.mark.parametrize("name", list(CASES))
def test_clipping_follows_one_process_under_every_split(clipped_runs: Path, name: str) -> None:
    reference = train_reference(STEPS, grad_clip=GRAD_CLIP)
    assert min(reference.grad_norms) > GRAD_CLIP  # clipping changes every step, so a wrong norm would show
    losses, norms = zip(*json.loads((clipped_runs / f"{name}.json").read_text()))
    assert list(norms) == pytest.approx(reference.grad_norms, rel=1e-5, abs=1e-6)
    assert list(losses) == pytest.approx(reference.losses, abs=1e-5)


def test_unclipped_run_differs_from_clipped_one() -> None:
    assert train_reference(STEPS).losses[1:] != pytest.approx(
        train_reference(STEPS, grad_clip=GRAD_CLIP).losses[1:], abs=1e-5
    )


# -- blocks wherever they sit -----------------------------------------------------------------------------------


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Encoder(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.h = nn.ModuleList(Layer() for _ in range(layers))
        self.heads = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])  # mixed classes: not blocks


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = Encoder(3)
        self.extra = nn.ModuleList([Layer(), Layer()])


def test_blocks_are_the_largest_list_of_one_class_at_any_depth() -> None:
    model = Nested()
    assert repeated_blocks(model) == list(model.transformer.h)


def test_hugging_face_no_split_modules_name_the_blocks() -> None:
    model = Nested()
    model._no_split_modules = ["Layer"]
    assert repeated_blocks(model) == [*model.transformer.h, *model.extra]


def test_parallel_blocks_override_and_a_class_the_model_lacks_is_named() -> None:
    model = Nested()
    assert repeated_blocks(model, ["Encoder"]) == [model.transformer]
    with pytest.raises(JobInputError) as raised:
        repeated_blocks(model, ["Decoder"])
    line = Nested.__init__.__code__.co_firstlineno - 1  # the class statement, which inspect names
    assert str(raised.value).startswith(
        "parallel.blocks ['Decoder']: model Nested (defined at "
        f"tests/workers/trainer/test_grad_clip_and_blocks.py:{line}) has no module of these classes; its classes are "
        "['Encoder', "
    )
    with pytest.raises(ValidationError, match="Python class name"):
        JobSpec(name="b", model="mlp", parallel={"blocks": ["not a name"]})


# -- activation checkpointing and compile -----------------------------------------------------------------------


def _tiny_gpt(**train) -> JobSpec:
    return JobSpec.model_validate(
        {
            **strategy_spec("ac", "ddp", 1, 3, GLOBAL_BATCH),
            "train": {**strategy_spec("ac", "ddp", 1, 3, GLOBAL_BATCH)["train"], **train},
        }
    )


def _peak_activation_bytes(mode: str) -> int:
    """Of one forward and backward of a small GPT-2."""
    return peak_activation_bytes(
        JobSpec(
            name="ac",
            model="hf:GPT2LMHeadModel",
            model_options={
                "vocab_size": 256,
                "n_embd": 64,
                "n_layer": 4,
                "n_head": 4,
                "n_positions": 64,
                "seq_len": 64,
                "max_corpus_bytes": 32_768,
            },
        ),
        mode,
    )


def test_checkpointing_keeps_fewer_activations_full_fewer_than_selective() -> None:
    none, selective, full = (_peak_activation_bytes(mode) for mode in ("none", "selective", "full"))
    assert full < selective < none


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_training_gives_identical_losses(tmp_path: Path, single_rank_group: None, mode: str) -> None:
    def losses(spec: JobSpec, root: Path) -> list[float]:
        points: list = []
        run_training(
            spec, TrainContext(0, 1, torch.device("cpu"), "ac", str(root), sink=CallbackSink(on_metric=points.append))
        )
        return [point.loss for point in points if point.loss is not None]

    assert losses(_tiny_gpt(activation_checkpointing=mode), tmp_path / mode) == losses(_tiny_gpt(), tmp_path / "none")


def test_compiled_blocks_train_like_eager_ones(tmp_path: Path, single_rank_group: None) -> None:
    """Within 1e-5 relative: inductor fuses the blocks' element-wise ops and reorders their fp32 sums, which moves the
    last bits (measured: ~1e-8 on a gradient), never more over a few steps."""

    def run(spec: JobSpec, root: Path) -> tuple[list[float], list[float]]:
        points: list = []
        run_training(
            spec, TrainContext(0, 1, torch.device("cpu"), "c", str(root), sink=CallbackSink(on_metric=points.append))
        )
        return [point.loss for point in points if point.loss is not None], [
            point.grad_norm for point in points if point.loss is not None
        ]

    eager_losses, eager_norms = run(_tiny_gpt(), tmp_path / "eager")
    torch._dynamo.utils.counters.clear()
    compiled_losses, compiled_norms = run(_tiny_gpt(compile=True), tmp_path / "compiled")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the blocks did go through torch.compile
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5)
    assert compiled_norms == pytest.approx(eager_norms, rel=1e-5)
