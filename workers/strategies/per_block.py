"""What goes on each repeated block before the data-parallel wrapper wraps it: activation checkpointing (composable,
so parameter names stay the model's) and torch.compile of the block's forward (for the same reason). The hooks of
checkpointing and FSDP stay outside the compiled code, around it."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts

from ringmaster.workers.torch_internals import composable_checkpoint

# selective: recompute what is cheap to recompute, element-wise ops and norms, whose outputs hold much of a block's
# activation memory, and keep everything else (matrix multiplications, attention, views). Listing what to recompute
# rather than what to keep leaves every op a model's code may run unforeseen kept, which is always safe to replay.
_RECOMPUTED_OPS = {
    torch.ops.aten.gelu.default,
    torch.ops.aten.silu.default,
    torch.ops.aten.relu.default,
    torch.ops.aten.tanh.default,
    torch.ops.aten.sigmoid.default,
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.add.Tensor,
    torch.ops.aten.pow.Tensor_Scalar,
    torch.ops.aten.mean.dim,
    torch.ops.aten.rsqrt.default,
    torch.ops.aten.native_layer_norm.default,
    torch.ops.aten._to_copy.default,
    # dropout: its mask is drawn in place into a new tensor, which must not be kept (replayed with the saved RNG state)
    torch.ops.aten.native_dropout.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.bernoulli_.float,
    torch.ops.aten.div_.Scalar,
    torch.ops.aten.div.Scalar,
}


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str) -> None:
    """mode full: a block keeps only its input and recomputes the rest in backward; selective: recomputes only
    _RECOMPUTED_OPS."""
    if mode == "none":
        return
    for block in blocks:
        if mode == "full":
            composable_checkpoint(block)
        else:
            composable_checkpoint(block, context_fn=partial(create_selective_checkpoint_contexts, _recompute_cheap_ops))


def _recompute_cheap_ops(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE if op in _RECOMPUTED_OPS else CheckpointPolicy.MUST_SAVE


def compile_blocks(model: nn.Module, blocks: list[nn.Module]) -> None:
    """torch.compile each block's forward (blocks of one class share the compiled code); the whole model's when it has
    no repeated blocks."""
    for module in blocks or [model]:
        module.forward = torch.compile(module.forward)
