"""A user's own Hugging Face model: a function returning a transformers GPT-2 built from a config (random weights, no
download) with its data and loss. ringmaster finds its blocks (GPT2Block) for FSDP, activation checkpointing and
pipeline splits by itself; nothing here is ringmaster-specific but the return value."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from ringmaster.workers.models import ModelBundle


def next_token_loss(model, batch):
    inputs, targets = batch
    return F.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), targets.flatten())


def build(
    layers: int = 2,
    width: int = 32,
    heads: int = 4,
    seq_len: int = 32,
    text_path: str | None = None,
    tie_word_embeddings: bool = True,
) -> ModelBundle:
    """Byte-level GPT-2 on the bytes of ``text_path`` (default: this file, repeated); the last tenth is validation."""
    config = GPT2Config(
        vocab_size=256,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        n_positions=seq_len,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tie_word_embeddings,
    )
    text = Path(text_path or __file__).read_bytes() * 4
    windows = torch.tensor(list(text[: len(text) // (seq_len + 1) * (seq_len + 1)])).view(-1, seq_len + 1)
    split = max(1, len(windows) // 10)
    train, validation = windows[:-split], windows[-split:]
    return ModelBundle(
        GPT2LMHeadModel(config),
        TensorDataset(train[:, :-1], train[:, 1:]),
        TensorDataset(validation[:, :-1], validation[:, 1:]),
        next_token_loss,
    )
