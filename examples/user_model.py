"""An example user model: copy this file, change the model and data, and point ``model:`` at ``build``.

The contract is the one the built-ins use: a function that takes ``model_options`` as keyword
arguments and returns a ``ModelBundle`` (or a tuple ``(model, train_dataset, loss_fn[, val_dataset])``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from ringmaster.workers.models import ModelBundle


class BigramLanguageModel(nn.Module):
    """Predicts each byte from the previous one alone: the smallest language model that learns."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(256, dim)
        self.head = nn.Linear(dim, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens))


def next_byte_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


def build(text_path: str | None = None, seq_len: int = 32, dim: int = 32) -> ModelBundle:
    """Train on the bytes of ``text_path`` (default: this file); the last tenth is validation."""
    text = Path(text_path or __file__).read_bytes()
    windows = torch.tensor(list(text[: len(text) // (seq_len + 1) * (seq_len + 1)])).view(-1, seq_len + 1)
    split = max(1, len(windows) // 10)
    train, validation = windows[:-split], windows[-split:]
    return ModelBundle(
        model=BigramLanguageModel(dim),
        train_dataset=TensorDataset(train[:, :-1], train[:, 1:]),
        val_dataset=TensorDataset(validation[:, :-1], validation[:, 1:]),
        loss_fn=next_byte_loss,
    )
