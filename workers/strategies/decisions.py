"""What the composition decided, in words a model's author recognises: the repeated blocks it found and where, the
FSDP units, which modules each pipeline stage holds, where the tensor-parallel plan came from, and what activation
checkpointing and torch.compile apply to. Reported once per formation of the group, as an event and a log line, so a
surprising layout (a model whose blocks were not found, a lopsided split) is seen before it costs a run."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn

from ringmaster.service.catalogue import StrategyEntry
from ringmaster.workers.models.registry import ModelBundle
from ringmaster.workers.strategies.blocks import block_container, repeated_blocks
from ringmaster.workers.strategies.parallel_model import ParallelSetup
from ringmaster.workers.strategies.param_groups import unwrapped_name


def describe_blocks(model: nn.Module, blocks: list[nn.Module]) -> str:
    """'4 × Block at layers' (or several classes, or 'none found')."""
    if not blocks:
        return "none found"
    classes = Counter(type(block).__name__ for block in blocks)
    counted = ", ".join(f"{count} × {name}" for name, count in classes.items())
    found = block_container(model, blocks)
    return f"{counted} at {found[0]}" if found is not None and found[0] else counted


def _pieces(model: nn.Module, blocks: list[nn.Module]) -> dict[str, str]:
    """Each parameter name of the unsplit model -> the piece a person would name: its block ('layers.3'), or else
    the module that holds it ('tok_embeddings', 'norm')."""
    block_names = {id(module): name for name, module in model.named_modules() if module in blocks}
    pieces: dict[str, str] = {}
    for module_name, module in model.named_modules():
        for local_name, _ in module.named_parameters(recurse=False):
            pieces[f"{module_name}.{local_name}" if module_name else local_name] = module_name or local_name
    for block_id, block_name in block_names.items():
        block = next(module for module in blocks if id(module) == block_id)
        for local_name, _ in block.named_parameters():
            pieces[f"{block_name}.{local_name}"] = block_name
    return pieces


def _held_pieces(stage: nn.Module, pieces: dict[str, str]) -> list[str]:
    """The pieces a pipeline stage holds, in order (stages keep the unsplit model's parameter names)."""
    held = list(
        dict.fromkeys(pieces.get(unwrapped_name(name), unwrapped_name(name)) for name, _ in stage.named_parameters())
    )
    return _ranged(held)


def _ranged(names: list[str]) -> list[str]:
    """layers.0, layers.1, layers.2 → layers.0–2: runs of consecutive numbered siblings as one entry."""
    ranged: list[str] = []
    run: list[tuple[str, int]] = []

    def close() -> None:
        if len(run) >= 3:
            ranged.append(f"{run[0][0]}.{run[0][1]}–{run[-1][1]}")
        else:
            ranged.extend(f"{prefix}.{number}" for prefix, number in run)
        run.clear()

    for name in names:
        prefix, _, key = name.rpartition(".")
        if key.isdigit() and run and run[-1][0] == prefix and run[-1][1] + 1 == int(key):
            run.append((prefix, int(key)))
            continue
        close()
        if key.isdigit() and prefix:
            run.append((prefix, int(key)))
        else:
            ranged.append(name)
    close()
    return ranged


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _hook_name(hook: Callable[..., Any] | None) -> str:
    if hook is None:
        return "none"
    owner = getattr(hook, "__self__", None)
    name = getattr(hook, "__qualname__", type(hook).__qualname__)
    module = getattr(hook, "__module__", None) or type(owner).__module__
    return f"{module}.{name}"


def decisions(
    bundle: ModelBundle,
    setup: ParallelSetup,
    entry: StrategyEntry,
    stage_indices: list[int],
    stages: list[nn.Module],
) -> dict[str, Any]:
    """This rank's view of the composition (called on every rank before the parts are wrapped; collective where the
    model is pipelined: every rank's stages are gathered)."""
    spec, dims = setup.spec, setup.dims
    blocks = repeated_blocks(bundle.model, spec.parallel.blocks)
    found = describe_blocks(bundle.model, blocks)
    source = (
        "parallel.blocks"
        if spec.parallel.blocks
        else "the model's _no_split_modules"
        if getattr(bundle.model, "_no_split_modules", None)
        else "the largest container of same-class modules"
    )
    decided: dict[str, Any] = {"blocks": f"{found} (from {source})"}
    fsdp = entry.data_parallel == "fsdp" and (dims.dp > 1 or entry.wraps_one_replica)
    if fsdp:
        decided["fsdp_units"] = f"{found}, and the root ({spec.parallel.shard})"
    if dims.tp > 1:
        decided["tensor_parallel"] = f"tp = {dims.tp}, plan from {_hook_name(bundle.tensor_parallel)}"
    train = spec.train
    decided["activation_checkpointing"] = (
        f"{train.activation_checkpointing}: {found}" if train.activation_checkpointing != "none" else "none"
    )
    decided["compile"] = (f"each block: {found}" if blocks else "the whole model") if train.compile else "none"
    if dims.pp > 1:
        pieces = _pieces(bundle.model, blocks)
        mine = [(index, _held_pieces(stage, pieces)) for index, stage in zip(stage_indices, stages, strict=True)]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (setup.mesh.get_local_rank("pp"), mine))
        by_stage = {index: (pp_rank, held) for pp_rank, stages_held in gathered for index, held in stages_held}
        decided["pipeline_stages"] = [
            f"stage {index} (pp rank {pp_rank}): {', '.join(held) or 'no parameters'}"
            for index, (pp_rank, held) in sorted(by_stage.items())
        ]
    return decided


def summary(decided: dict[str, Any]) -> str:
    """One line of the decisions, for the job's events and the driver's log."""
    parts = [f"blocks {decided['blocks']}"]
    if "fsdp_units" in decided:
        parts.append(f"FSDP units {decided['fsdp_units']}")
    if "tensor_parallel" in decided:
        parts.append(f"tensor parallel {decided['tensor_parallel']}")
    if "pipeline_stages" in decided:
        parts.append("; ".join(decided["pipeline_stages"]))
    parts.append(f"activation checkpointing {decided['activation_checkpointing']}")
    parts.append(f"compile {decided['compile']}")
    return "parallelized: " + "; ".join(parts)
