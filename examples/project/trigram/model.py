"""Predicts each byte from the two before it, trained on this project's own source files.

Nothing here is installed anywhere: `ringmaster submit job.yaml --code .` packs this directory, and every worker
imports `trigram.model` from the job's copy of it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from ringmaster.workers.models import ModelBundle

PROJECT = Path(__file__).resolve().parents[1]


class TrigramLanguageModel(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(256, dim)
        self.mix = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, 256)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        """context: (batch, 2) bytes -> (batch, 256) logits of the next one."""
        return self.head(torch.tanh(self.mix(self.embedding(context).flatten(1))))


def next_byte_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    context, targets = batch
    return F.cross_entropy(model(context), targets)


def corpus() -> bytes:
    """The project's Python sources, in a fixed order: every worker reads the same bytes."""
    return b"\n".join(path.read_bytes() for path in sorted(PROJECT.rglob("*.py")))


def build(dim: int = 32) -> ModelBundle:
    data = torch.tensor(list(corpus()))
    context = torch.stack([data[:-2], data[1:-1]], dim=1)
    targets = data[2:]
    split = len(targets) * 9 // 10
    return ModelBundle(
        model=TrigramLanguageModel(dim),
        train_dataset=TensorDataset(context[:split], targets[:split]),
        val_dataset=TensorDataset(context[split:], targets[split:]),
        loss_fn=next_byte_loss,
    )
