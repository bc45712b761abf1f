"""ZeRO-1: the optimizer state (Adam moments) sharded over the dp group; each rank steps only the parameters it owns
and then broadcasts them to the others."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from torch import nn
from torch.optim import Optimizer

from ringmaster.workers.strategies.parallel_model import ParallelSetup

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

# Imported only by a job that shards its optimizer: torch.distributed.optim compiles every functional optimizer with
# TorchScript when imported, 0.15 s of the start of a worker that must import the training stack cold.
_ZERO_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"


def sharded_optimizer(model: nn.Module, setup: ParallelSetup) -> ZeroRedundancyOptimizer:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        setup.optimizer.groups_of(model),
        optimizer_class=setup.optimizer.optimizer_class,
        process_group=setup.mesh["dp"].get_group(),
        **setup.optimizer.options,
    )


def local_optimizer(optimizer: Optimizer) -> Optimizer:
    """The optimizer holding this rank's state: ZeRO-1's inner one over the parameters this rank owns."""
    zero = sys.modules.get(_ZERO_MODULE)  # not imported: no optimizer here is ZeRO's
    return optimizer.optim if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer) else optimizer
