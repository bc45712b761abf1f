"""FSDP2: parameters, gradients and optimizer state sharded over the dp mesh (ZeRO-2/3), or hybrid:
sharded within a node and replicated across nodes on the 2-D (dp_replicate, dp_shard) mesh; and FSDP2's
replicate, the data-parallel wrapper that (unlike DDP) holds tensor-parallel DTensor parameters."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ringmaster.workers.strategies.blocks import repeated_blocks
from ringmaster.workers.strategies.parallel_model import ParallelSetup
from ringmaster.workers.torch_internals import replicate


def apply_fsdp(module: nn.Module, setup: ParallelSetup) -> FSDPModule:
    """fully_shard each block, then the root. zero3 (and hybrid) free gathered parameters after forward
    and gather again in backward; zero2 keeps them until backward. bf16 computes in bf16, reduces in fp32."""
    mesh = setup.mesh[setup.dims.dp_mesh_names]
    reshard_after_forward = setup.spec.parallel.shard != "zero2"
    for block in repeated_blocks(module, setup.spec.parallel.blocks):
        fully_shard(
            block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mixed_precision(setup, root=False)
        )
    return fully_shard(
        module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mixed_precision(setup, root=True)
    )


def apply_replicate(module: nn.Module, setup: ParallelSetup) -> FSDPModule:
    """Replicas over dp with a mesh-aware all-reduce of gradients."""
    return replicate(module, mesh=setup.mesh["dp"], mp_policy=mixed_precision(setup, root=True))


def mixed_precision(setup: ParallelSetup, root: bool) -> MixedPrecisionPolicy:
    """bf16: FSDP2 (and its replicate) cast parameters to bf16 for compute and reduce gradients in fp32;
    the root hands back fp32 outputs so the loss is computed in fp32, as under autocast."""
    if not setup.bf16:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32 if root else None
    )


@contextmanager
def without_gradient_sync(model: FSDPModule) -> Iterator[None]:
    """Backward keeps unsharded gradients locally; the next synced backward reduces them all at once."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
