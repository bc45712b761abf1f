"""3D: dp × pp × tp on the one mesh. The pipeline split comes first; then every stage (or the whole
model when pp = 1) gets TP over tp and then FSDP over dp, always in that order (torchtitan's)."""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ringmaster.workers.models.registry import ModelBundle
from ringmaster.workers.strategies.fsdp import apply_fsdp, without_gradient_sync
from ringmaster.workers.strategies.parallel_model import ParallelModel, ParallelSetup
from ringmaster.workers.strategies.pipeline import build_pipeline
from ringmaster.workers.strategies.tensor import apply_tensor_parallel


def parallelize_3d(bundle: ModelBundle, setup: ParallelSetup) -> ParallelModel:
    def tensor_then_fsdp(module: nn.Module) -> nn.Module:
        if setup.dims.tp > 1:
            apply_tensor_parallel(module, bundle, setup)
        return apply_fsdp(module, setup) if setup.dims.dp > 1 else module

    if setup.dims.pp > 1:
        return build_pipeline(bundle, setup, tensor_then_fsdp)
    model = tensor_then_fsdp(bundle.model)
    accumulate_locally = partial(without_gradient_sync, model) if isinstance(model, FSDPModule) else nullcontext
    return ParallelModel(parts=[model], optimizers=[setup.optimizer.build(model.parameters())],
                         holds_loss=setup.mesh.get_local_rank("tp") == 0, accumulate_locally=accumulate_locally)
