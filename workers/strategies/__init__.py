"""Parallelism strategies, one sibling module each, chosen by ``spec.strategy`` through STRATEGIES.

Each takes the model bundle and the setup (spec, dimensions, the one DeviceMesh, device) and returns
a ParallelModel; none creates process groups of its own, they take sub-meshes by name.
"""

from __future__ import annotations

from typing import Callable

from ringmaster.workers.models.registry import ModelBundle
from ringmaster.workers.strategies.ddp import parallelize_ddp
from ringmaster.workers.strategies.fsdp import parallelize_fsdp
from ringmaster.workers.strategies.parallel_model import OptimizerConfig, ParallelModel, ParallelSetup
from ringmaster.workers.strategies.pipeline import parallelize_pipeline
from ringmaster.workers.strategies.tensor import parallelize_tensor
from ringmaster.workers.strategies.three_d import parallelize_3d
from ringmaster.workers.strategies.zero1 import parallelize_zero1

Parallelize = Callable[[ModelBundle, ParallelSetup], ParallelModel]

STRATEGIES: dict[str, Parallelize] = {
    "ddp": parallelize_ddp,
    "zero1": parallelize_zero1,
    "fsdp": parallelize_fsdp,
    "pipeline": parallelize_pipeline,
    "tensor": parallelize_tensor,
    "3d": parallelize_3d,
}

__all__ = ["STRATEGIES", "OptimizerConfig", "ParallelModel", "ParallelSetup", "parallelize"]


def parallelize(bundle: ModelBundle, setup: ParallelSetup) -> ParallelModel:
    """Apply ``setup.spec.strategy`` to a bundle whose model is already on ``setup.device``."""
    strategy = setup.spec.strategy
    if strategy not in STRATEGIES:
        raise ValueError(
            f"strategy {strategy!r} must be resolved before training (by the planner for 'auto'); available: {sorted(STRATEGIES)}"
        )
    return STRATEGIES[strategy](bundle, setup)
