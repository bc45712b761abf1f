"""A small byte-level decoder-only transformer in plain PyTorch, laid out the torchtitan way.

Blocks sit in ``layers`` (a ModuleDict named "0", "1", …) so checkpoint keys survive pipeline
splitting; attention keeps separate wq/wk/wv/wo and the MLP w1/w2 so a tensor-parallel plan can
shard them column-/row-wise; embeddings and head may be ``None`` on a pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ringmaster.workers.data.pysource import DEFAULT_MAX_CORPUS_BYTES, pysource_splits
from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.models.registry import ModelBundle, PipelineStageFn, TensorParallelPlan
from ringmaster.workers.models.tiny_gpt_parallelize import apply_tensor_parallel, pipeline_stage


@dataclass(frozen=True)
class TinyGPTConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 64
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise JobInputError(f"tiny-gpt: dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")


class Attention(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # Heads are inferred (-1) so a column-sharded wq/wk/wv yields the local heads unchanged.
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        return projected


class FeedForward(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.mlp_ratio * config.dim, bias=False)
        self.w2 = nn.Linear(config.mlp_ratio * config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.gelu(self.w1(x)))
        return out


class TransformerBlock(nn.Module):
    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.dim)
        self.attention = Attention(config)
        self.ffn_norm = nn.LayerNorm(config.dim)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        out: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


class TinyGPT(nn.Module):
    """Token ids in, next-token logits out; on a middle pipeline stage, hidden states in and out."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(config.seq_len, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(config.dim)
        self.output: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = tokens
        if self.tok_embeddings is not None:
            # Slicing the position table avoids allocating an index tensor (or a buffer DDP would broadcast). A
            # pipeline stage keeps both embeddings or neither.
            h = self.tok_embeddings(tokens) + cast(nn.Embedding, self.pos_embeddings).weight[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def _init_weights(module: nn.Module) -> None:
    """Small normal init keeps the initial loss near log(vocab) regardless of width."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def next_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy over every position of every sequence in the batch."""
    inputs, targets = batch
    return logits_loss(model(inputs), targets)


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same loss from logits already computed, e.g. by the last pipeline stage."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(
    n_layers: int = 2,
    n_heads: int = 4,
    dim: int = 64,
    seq_len: int = 64,
    vocab: int = 256,
    max_corpus_bytes: int = DEFAULT_MAX_CORPUS_BYTES,
) -> ModelBundle:
    """Built-in "tiny-gpt": the transformer trained on the Python standard library's source."""
    if vocab < 256:
        raise JobInputError(f"tiny-gpt: vocab must be at least 256 to hold every byte, got {vocab}")
    config = TinyGPTConfig(vocab_size=vocab, dim=dim, n_layers=n_layers, n_heads=n_heads, seq_len=seq_len)
    train_dataset, val_dataset = pysource_splits(seq_len=seq_len, max_corpus_bytes=max_corpus_bytes)
    return ModelBundle(
        TinyGPT(config),
        train_dataset,
        val_dataset,
        next_token_loss,
        # The hooks are given this bundle's model, a TinyGPT.
        tensor_parallel=cast(TensorParallelPlan, apply_tensor_parallel),
        pipeline_stage=cast(PipelineStageFn, pipeline_stage),
        output_loss_fn=logits_loss,
    )
