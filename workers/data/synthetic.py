"""Synthetic regression data for the MLP: y = W·x + noise, fully determined by a seed."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def synthetic_regression_splits(
    in_dim: int = 16,
    out_dim: int = 4,
    n_train: int = 4096,
    n_val: int = 512,
    noise: float = 0.01,
    data_seed: int = 0,
) -> tuple[TensorDataset, TensorDataset]:
    """Train and validation (x, y) datasets drawn from one private generator, so the data never
    depends on (or disturbs) the global RNG that seeds model init."""
    generator = torch.Generator().manual_seed(data_seed)
    weight = torch.randn(in_dim, out_dim, generator=generator) / in_dim**0.5
    inputs = torch.randn(n_train + n_val, in_dim, generator=generator)
    targets = inputs @ weight + noise * torch.randn(n_train + n_val, out_dim, generator=generator)
    return TensorDataset(inputs[:n_train], targets[:n_train]), TensorDataset(inputs[n_train:], targets[n_train:])
