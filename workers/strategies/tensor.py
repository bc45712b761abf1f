"""Tensor parallel: the model's own plan (Megatron-style for tiny-gpt) over the tp mesh; data-parallel
replicas of the split model, if any, synchronise gradients with FSDP2's replicate over dp."""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate

from ringmaster.workers.models.registry import ModelBundle
from ringmaster.workers.strategies.fsdp import mixed_precision, without_gradient_sync
from ringmaster.workers.strategies.parallel_model import ParallelModel, ParallelSetup


def parallelize_tensor(bundle: ModelBundle, setup: ParallelSetup) -> ParallelModel:
    model = bundle.model
    apply_tensor_parallel(model, bundle, setup)
    accumulate_locally = nullcontext
    if setup.dims.dp > 1:
        # DDP cannot hold TP's DTensor parameters; FSDP2's replicate can (mesh-aware all-reduce).
        model = replicate(model, mesh=setup.mesh["dp"], mp_policy=mixed_precision(setup, root=True))
        accumulate_locally = partial(without_gradient_sync, model)
    return ParallelModel(parts=[model], optimizers=[setup.optimizer.build(model.parameters())],
                         holds_loss=setup.mesh.get_local_rank("tp") == 0, accumulate_locally=accumulate_locally)


def apply_tensor_parallel(module: nn.Module, bundle: ModelBundle, setup: ParallelSetup) -> None:
    """Shard ``module`` in place with the bundle's plan over the tp sub-mesh."""
    if bundle.tensor_parallel is None:
        raise ValueError(
            f"strategy {setup.spec.strategy!r} with parallel.tp = {setup.dims.tp} needs a tensor-parallel plan, "
            f"but model {setup.spec.model!r} supplies no ModelBundle.tensor_parallel"
        )
    bundle.tensor_parallel(module, setup.mesh["tp"])
