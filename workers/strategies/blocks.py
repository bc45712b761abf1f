"""A model's repeated blocks, wherever they sit: the units FSDP shards, activation checkpointing recomputes, compile
compiles and the pipeline splits at. Found in this order: the class names in parallel.blocks; a Hugging Face model's
``_no_split_modules``; else the largest ModuleList/ModuleDict of same-class modules at any depth."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from ringmaster.workers.job_input import JobInputError, defined_at


def repeated_blocks(model: nn.Module, class_names: Sequence[str] | None = None) -> list[nn.Module]:
    """The model's blocks in forward order (module registration order); [] for a model without repeated blocks."""
    names = list(class_names or getattr(model, "_no_split_modules", None) or ())
    if names:
        blocks = list(_outermost(model, set(names)))
        if class_names and not blocks:
            present = sorted({type(module).__name__ for module in model.modules()})
            raise JobInputError(
                f"parallel.blocks {list(class_names)}: model {named_model(model)} has no module of these classes; "
                f"its classes are {present}"
            )
        if blocks:
            return blocks
    return _largest_uniform_container(model)


def block_container(model: nn.Module, blocks: list[nn.Module]) -> tuple[str, nn.ModuleList | nn.ModuleDict] | None:
    """The container (its qualified name and module) that holds every block as a direct child, when one does:
    where a pipeline stage deletes the blocks of other stages."""
    wanted = {id(block) for block in blocks}
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and wanted <= {id(child) for child in module.children()}:
            return name, module
    return None


def _outermost(model: nn.Module, names: set[str]) -> Iterable[nn.Module]:
    """Modules of the named classes, not descending into one once found."""
    for child in model.children():
        if type(child).__name__ in names:
            yield child
        else:
            yield from _outermost(child, names)


def _largest_uniform_container(model: nn.Module) -> list[nn.Module]:
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            children = list(module.children())
            if len(children) > len(best) and len({type(child) for child in children}) == 1:
                best = children
    return best


def named_model(model: nn.Module) -> str:
    """A model's class, and where the job's code defines it."""
    where = defined_at(type(model))
    return f"{type(model).__name__} (defined at {where})" if where else type(model).__name__
