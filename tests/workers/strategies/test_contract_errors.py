"""A model that lacks what its strategy needs fails the job in one line that names the model's class and the file and
line of the job's code that define it (a JobInputError: the job fails with the message alone)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch import nn

from ringmaster.service.spec import JobSpec
from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.models.registry import ModelBundle
from ringmaster.workers.strategies.parallel_model import ParallelSetup
from ringmaster.workers.strategies.pipeline import split_stages
from ringmaster.workers.strategies.tensor import apply_tensor_parallel

HERE = "tests/workers/strategies/test_contract_errors.py"


class HooklessModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])


def _setup(strategy: str, **parallel: Any) -> ParallelSetup:
    spec = JobSpec(
        name="hookless",
        model="mypackage.model:build",
        strategy=strategy,
        parallel=parallel,
        workers={"min": 2, "max": 2},
        train={"global_batch_size": 8, "micro_batch_size": 2},
    )
    return cast(ParallelSetup, SimpleNamespace(spec=spec, dims=SimpleNamespace(tp=parallel.get("tp", 1))))


def _bundle() -> ModelBundle:
    return ModelBundle(HooklessModel(), None, None, lambda model, batch: torch.zeros(()))


LINE = HooklessModel.__init__.__code__.co_firstlineno - 1


def test_a_pipeline_without_stage_hooks_names_the_models_class_and_where_it_is_defined() -> None:
    with pytest.raises(JobInputError) as raised:
        split_stages(_bundle(), _setup("pipeline", pp=2, microbatches=4))
    assert str(raised.value) == (
        "strategy 'pipeline' with parallel.pp = 2 needs ModelBundle.pipeline_stage and ModelBundle.output_loss_fn, but "
        f"model 'mypackage.model:build', a HooklessModel (defined at {HERE}:{LINE}), does not supply both"
    )


def test_tensor_parallel_without_a_plan_names_the_models_class_and_where_it_is_defined() -> None:
    bundle = _bundle()
    with pytest.raises(JobInputError) as raised:
        apply_tensor_parallel(bundle.model, bundle, _setup("tensor", tp=2))
    assert str(raised.value) == (
        "strategy 'tensor' with parallel.tp = 2 needs a tensor-parallel plan, but model 'mypackage.model:build', "
        f"a HooklessModel (defined at {HERE}:{LINE}), supplies no ModelBundle.tensor_parallel"
    )
