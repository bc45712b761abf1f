"""One composition for every strategy, always in the same order (torchtitan's): the pipeline split, then tensor
parallel on each stage (or the whole model), then the data-parallel wrapper, chosen once from the strategy's
catalogue entry and the mesh. Activation checkpointing and torch.compile go per block between tensor parallel and the
data-parallel wrapper, so FSDP wraps the checkpointed, compiled blocks."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any, cast

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ringmaster.service.catalogue import STRATEGIES, StrategyEntry
from ringmaster.workers.models.registry import ModelBundle
from ringmaster.workers.strategies.blocks import repeated_blocks
from ringmaster.workers.strategies.ddp import wrap_ddp
from ringmaster.workers.strategies.decisions import decisions
from ringmaster.workers.strategies.fsdp import apply_fsdp, apply_replicate, without_gradient_sync
from ringmaster.workers.strategies.parallel_model import ParallelModel, ParallelSetup
from ringmaster.workers.strategies.per_block import apply_activation_checkpointing, compile_blocks
from ringmaster.workers.strategies.pipeline import build_schedule, shared_parameters, split_stages, tied_across_stages
from ringmaster.workers.strategies.tensor import apply_tensor_parallel
from ringmaster.workers.strategies.zero1 import sharded_optimizer

# A wrapped module -> the context in which its backward only accumulates gradients locally (no sync).
LocalAccumulation = Callable[[nn.Module], Callable[[], AbstractContextManager[Any]]]


def parallelize(bundle: ModelBundle, setup: ParallelSetup) -> ParallelModel:
    """Apply ``setup.spec.strategy`` to a bundle whose model is already on ``setup.device``."""
    strategy = setup.spec.strategy
    if strategy not in STRATEGIES:
        raise ValueError(
            f"strategy {strategy!r} must be resolved before training (by the planner for 'auto'); "
            f"available: {sorted(STRATEGIES)}"
        )
    entry, dims = STRATEGIES[strategy], setup.dims
    pipelined = dims.pp > 1
    shared = shared_parameters(bundle.model) if pipelined else []
    indices, modules = split_stages(bundle, setup) if pipelined else ([], [bundle.model])
    decided = decisions(bundle, setup, entry, indices, modules)
    if dims.tp > 1:
        for module in modules:
            apply_tensor_parallel(module, bundle, setup)
    train = setup.spec.train
    for module in modules:
        blocks = repeated_blocks(module, setup.spec.parallel.blocks)
        apply_activation_checkpointing(blocks, train.activation_checkpointing)
        if train.compile:
            compile_blocks(module, blocks)
    wrap, local_accumulation = _data_parallel(entry, setup)
    parts = [wrap(module) for module in modules]
    optimizers = [
        sharded_optimizer(part, setup) if entry.shards_optimizer else setup.optimizer.build(part) for part in parts
    ]
    first_tp_rank = setup.dims.local_rank(setup.mesh, "tp") == 0
    if not pipelined:
        replicated = entry.data_parallel == "ddp" and not entry.shards_optimizer and dims.tp == 1
        return ParallelModel(
            parts=parts,
            optimizers=optimizers,
            holds_loss=first_tp_rank,
            accumulate_locally=local_accumulation(parts[0]),
            state_replicated=replicated,
            decisions=decided,
        )
    # The schedule runs a step's micro-batches itself; each of its backward passes syncs.
    schedule, stages = build_schedule(parts, indices, bundle, setup)
    return ParallelModel(
        parts=parts,
        optimizers=optimizers,
        holds_loss=stages[-1].is_last and first_tp_rank,
        schedule=schedule,
        stages=stages,
        tied=tied_across_stages(shared, parts, setup),
        decisions=decided,
    )


def _data_parallel(
    entry: StrategyEntry, setup: ParallelSetup
) -> tuple[Callable[[nn.Module], nn.Module], LocalAccumulation]:
    """How replicas synchronise: the entry's wrapper, or none for a single replica of a model-parallel strategy."""
    if setup.dims.dp == 1 and not entry.wraps_one_replica:
        return (lambda module: module), (lambda module: nullcontext)
    if entry.data_parallel == "ddp":
        return partial(wrap_ddp, setup=setup), (lambda module: module.no_sync)
    apply = apply_fsdp if entry.data_parallel == "fsdp" else apply_replicate
    # fully_shard and replicate hand back the module itself, its class made a subclass of FSDPModule as well.
    return cast(Callable[[nn.Module], nn.Module], partial(apply, setup=setup)), (
        lambda module: partial(without_gradient_sync, cast(FSDPModule, module))
    )
