"""Parallelism strategies, one sibling module each, chosen by ``spec.strategy`` through STRATEGIES."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from workers.strategies.ddp import parallelize_ddp

Parallelize = Callable[[nn.Module, torch.device], nn.Module]

STRATEGIES: dict[str, Parallelize] = {"ddp": parallelize_ddp}


def parallelize(strategy: str, model: nn.Module, device: torch.device) -> nn.Module:
    """Apply the named strategy to a model already moved to ``device``."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; available: {sorted(STRATEGIES)}")
    return STRATEGIES[strategy](model, device)
