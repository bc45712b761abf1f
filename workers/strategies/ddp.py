"""DDP: every replica holds the whole module and gradients are all-reduced over the dp mesh during backward."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ringmaster.workers.strategies.parallel_model import ParallelSetup


def wrap_ddp(module: nn.Module, setup: ParallelSetup) -> DistributedDataParallel:
    """DDP over the dp sub-mesh; it broadcasts the group's first rank's parameters, so replicas start equal."""
    device_ids = [setup.device] if setup.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, process_group=setup.mesh["dp"].get_group())
