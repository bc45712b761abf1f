"""Built-in "mlp": a small MLP regressor on synthetic linear data; the cheapest model to train."""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from ringmaster.workers.data.synthetic import synthetic_regression_splits
from ringmaster.workers.models.registry import ModelBundle


class MLPRegressor(nn.Module):
    def __init__(self, in_dim: int, hidden: int, out_dim: int, depth: int) -> None:
        super().__init__()
        widths = [in_dim] + [hidden] * depth
        self.hidden_layers = nn.ModuleList(nn.Linear(a, b) for a, b in pairwise(widths))
        self.output = nn.Linear(widths[-1], out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.hidden_layers:
            x = F.gelu(layer(x))
        out: torch.Tensor = self.output(x)
        return out


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


def build(
    in_dim: int = 16,
    hidden: int = 64,
    out_dim: int = 4,
    depth: int = 2,
    n_train: int = 4096,
    n_val: int = 512,
    noise: float = 0.01,
    data_seed: int = 0,
) -> ModelBundle:
    """The MLP and its synthetic data; the data seed is separate from the training seed on purpose."""
    train_dataset, val_dataset = synthetic_regression_splits(in_dim, out_dim, n_train, n_val, noise, data_seed)
    return ModelBundle(MLPRegressor(in_dim, hidden, out_dim, depth), train_dataset, val_dataset, mse_loss)
