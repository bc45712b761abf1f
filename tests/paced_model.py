"""The built-in MLP with a fixed pause in each training forward pass (``model: tests.paced_model:build``).

Steps then take a known time whatever the machine's load, so a failure test strikes mid-job.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from ringmaster.workers.models import ModelBundle
from ringmaster.workers.models.mlp import build as build_mlp


class PacedModel(nn.Module):
    def __init__(self, inner: nn.Module, pause_s: float) -> None:
        super().__init__()
        self.inner = inner
        self.pause_s = pause_s

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.training:  # validation stays fast
            time.sleep(self.pause_s)
        return self.inner(inputs)


def build(pause_s: float = 0.1, **mlp_options: Any) -> ModelBundle:
    bundle = build_mlp(**mlp_options)
    bundle.model = PacedModel(bundle.model, pause_s)
    return bundle
