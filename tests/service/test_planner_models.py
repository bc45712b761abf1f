"""The planner counts the built-ins' parameters by formula; these check the formulas against the real torch models."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from ringmaster.service.catalogue import BUILTIN_MODELS
from ringmaster.service.planner import builtin_model_size
from ringmaster.workers.models import mlp, tiny_gpt


def _count(module: Any) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"n_layers": 3, "n_heads": 6, "dim": 96, "seq_len": 32},
        {"n_layers": 1, "n_heads": 2, "dim": 32, "seq_len": 128, "vocab": 300},
    ],
)
def test_tiny_gpt_formula_equals_the_models_parameter_count(options: dict[str, int]) -> None:
    size = {**BUILTIN_MODELS["tiny-gpt"].size_defaults, **options}
    config = tiny_gpt.TinyGPTConfig(
        vocab_size=size["vocab"],
        dim=size["dim"],
        n_layers=size["n_layers"],
        n_heads=size["n_heads"],
        seq_len=size["seq_len"],
    )
    assert builtin_model_size("tiny-gpt", options).parameters == _count(tiny_gpt.TinyGPT(config))


@pytest.mark.parametrize("options", [{}, {"in_dim": 8, "hidden": 32, "out_dim": 2, "depth": 3}, {"depth": 0}])
def test_mlp_formula_equals_the_models_parameter_count(options: dict[str, int]) -> None:
    size = {**BUILTIN_MODELS["mlp"].size_defaults, **options}
    assert builtin_model_size("mlp", options).parameters == _count(mlp.MLPRegressor(**size))


@pytest.mark.parametrize(("name", "build"), [("tiny-gpt", tiny_gpt.build), ("mlp", mlp.build)])
def test_planner_knows_every_builder_option_and_its_size_defaults(name: str, build: Any) -> None:
    parameters = inspect.signature(build).parameters
    for option, default in BUILTIN_MODELS[name].size_defaults.items():
        assert parameters[option].default == default
    builtin_model_size(
        name, {option: parameter.default for option, parameter in parameters.items()}
    )  # accepts them all
