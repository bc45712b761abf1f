"""tiny-gpt's parallelize functions, kept beside the model so its code stays plain PyTorch:
the Megatron tensor-parallel plan and the pipeline split into contiguous blocks."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ringmaster.workers.job_input import JobInputError

if TYPE_CHECKING:
    from ringmaster.workers.models.tiny_gpt import TinyGPT


def apply_tensor_parallel(model: TinyGPT, tp_mesh: DeviceMesh) -> None:
    """Split every block Megatron-style: attention heads divide across the group (wq/wk/wv column-wise,
    wo row-wise) and so does the MLP's hidden layer (w1 column-wise, w2 row-wise), so each sub-block
    costs one all-reduce forward and one backward; embeddings, norms and head stay replicated."""
    config, degree = model.config, tp_mesh.size()
    if config.n_heads % degree or (config.mlp_ratio * config.dim) % degree:
        raise JobInputError(
            f"tiny-gpt: parallel.tp ({degree}) must divide n_heads ({config.n_heads}) and the MLP width "
            f"({config.mlp_ratio * config.dim})"
        )
    for block in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        }
        parallelize_module(block, tp_mesh, plan)


def pipeline_stage(model: TinyGPT, stage_index: int, num_stages: int) -> TinyGPT:
    """A copy of ``model`` keeping stage ``stage_index``'s contiguous blocks, with the embeddings on the
    first stage and norm and head on the last; block names ("layers.3") are the unsplit model's."""
    names = list(model.layers.keys())
    if len(names) < num_stages:
        raise JobInputError(
            f"tiny-gpt: {len(names)} layers cannot fill {num_stages} pipeline stages; use n_layers >= {num_stages}"
        )
    start, stop = len(names) * stage_index // num_stages, len(names) * (stage_index + 1) // num_stages
    stage = copy.deepcopy(model)
    for name in names[:start] + names[stop:]:
        del stage.layers[name]
    if stage_index > 0:
        stage.tok_embeddings = stage.pos_embeddings = None
    if stage_index < num_stages - 1:
        stage.norm = stage.output = None
    return stage
