"""What goes on each repeated block before the data-parallel wrapper wraps it: activation checkpointing (composable,
so parameter names stay the model's) and torch.compile of the block's forward (for the same reason). The hooks of
checkpointing and FSDP stay outside the compiled code, around it."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# selective: keep what is costly to recompute (matrix multiplications and attention), recompute the cheap rest
# (norms, activations, element-wise ops), which holds most of a block's activation memory.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str) -> None:
    """mode full: a block keeps only its input and recomputes the rest in backward; selective: also keeps _SAVED_OPS."""
    if mode == "none":
        return
    for block in blocks:
        if mode == "full":
            checkpoint(block)
        else:
            checkpoint(block, context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls))


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def compile_blocks(model: nn.Module, blocks: list[nn.Module]) -> None:
    """torch.compile each block's forward (blocks of one class share the compiled code); the whole model's when it has
    no repeated blocks."""
    for module in blocks or [model]:
        module.forward = torch.compile(module.forward)
