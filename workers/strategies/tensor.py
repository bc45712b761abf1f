"""Tensor parallel: the model's own plan (Megatron-style for tiny-gpt) over the tp mesh."""

from __future__ import annotations

from torch import nn

from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.models.registry import ModelBundle
from ringmaster.workers.strategies.blocks import named_model
from ringmaster.workers.strategies.parallel_model import ParallelSetup


def apply_tensor_parallel(module: nn.Module, bundle: ModelBundle, setup: ParallelSetup) -> None:
    """Shard ``module`` in place with the bundle's plan over the tp sub-mesh."""
    if bundle.tensor_parallel is None:
        raise JobInputError(
            f"strategy {setup.spec.strategy!r} with parallel.tp = {setup.dims.tp} needs a tensor-parallel plan, "
            f"but model {setup.spec.model!r}, a {named_model(module)}, supplies no ModelBundle.tensor_parallel"
        )
    bundle.tensor_parallel(module, setup.mesh["tp"])
