"""ZeRO-1: DDP gradients, with the optimizer state (Adam moments) sharded over the dp group."""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim import Optimizer

from ringmaster.workers.models.registry import ModelBundle
from ringmaster.workers.strategies.ddp import wrap_ddp
from ringmaster.workers.strategies.parallel_model import ParallelModel, ParallelSetup


def parallelize_zero1(bundle: ModelBundle, setup: ParallelSetup) -> ParallelModel:
    """Each rank steps only the parameters it owns and then broadcasts them to the others."""
    model = wrap_ddp(bundle.model, setup)
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(),
        optimizer_class=torch.optim.AdamW,
        process_group=setup.mesh["dp"].get_group(),
        lr=setup.optimizer.lr,
        weight_decay=setup.optimizer.weight_decay,
    )
    return ParallelModel(parts=[model], optimizers=[optimizer], holds_loss=True, accumulate_locally=model.no_sync)


def local_optimizer(optimizer: Optimizer) -> Optimizer:
    """The optimizer holding this rank's state: ZeRO-1's inner one over the parameters this rank owns."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
