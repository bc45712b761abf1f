"""DDP: every rank holds the whole model and gradients are all-reduced during backward."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def parallelize_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """Wrap a model already on ``device``; DDP broadcasts rank 0's parameters, so ranks start equal."""
    device_ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)
