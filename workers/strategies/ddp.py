"""DDP: every rank holds the whole model and gradients are all-reduced over the dp mesh during backward."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ringmaster.workers.models.registry import ModelBundle
from ringmaster.workers.strategies.parallel_model import ParallelModel, ParallelSetup


def parallelize_ddp(bundle: ModelBundle, setup: ParallelSetup) -> ParallelModel:
    model = wrap_ddp(bundle.model, setup)
    return ParallelModel(parts=[model], optimizers=[setup.optimizer.build(model.parameters())], holds_loss=True,
                         accumulate_locally=model.no_sync)


def wrap_ddp(module: nn.Module, setup: ParallelSetup) -> DistributedDataParallel:
    """DDP over the dp sub-mesh; it broadcasts the group's first rank's parameters, so replicas start equal."""
    device_ids = [setup.device] if setup.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, process_group=setup.mesh["dp"].get_group())
