"""ZeRO-1: the optimizer state (Adam moments) sharded over the dp group; each rank steps only the parameters it owns
and then broadcasts them to the others."""

from __future__ import annotations

from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from ringmaster.workers.strategies.parallel_model import ParallelSetup


def sharded_optimizer(model: nn.Module, setup: ParallelSetup) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=setup.optimizer.optimizer_class,
                                   process_group=setup.mesh["dp"].get_group(), **setup.optimizer.options)


def local_optimizer(optimizer: Optimizer) -> Optimizer:
    """The optimizer holding this rank's state: ZeRO-1's inner one over the parameters this rank owns."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
