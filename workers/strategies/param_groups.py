"""The optimizer's parameter groups (train.optimizer.no_decay and .groups), decided by each parameter's name in the
unsplit model and the kind of module that holds it, so every strategy groups the same parameters alike: DDP's,
torch.compile's and activation checkpointing's wrappers are left out of the name, and FSDP and tensor parallel keep
the module classes and names they wrap."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ringmaster.workers.job_input import JobInputError

# Name segments that wrappers insert between a module and its parameters (DDP's module, torch.compile's _orig_mod,
# activation checkpointing's wrapper).
_WRAPPER_SEGMENTS = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
# Normalization layers are found by class (a model's own RMSNorm included) as transformers' Trainer finds them.
_NORM_CLASSES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)


@dataclass(frozen=True)
class GroupRule:
    """One of train.optimizer.groups: the patterns that select its parameters, and what it sets for them."""

    patterns: tuple[str, ...]
    weight_decay: float | None = None
    lr_scale: float = 1.0


def unwrapped_name(name: str) -> str:
    """A parameter's name as the plain model names it, whatever wraps the module now."""
    return ".".join(segment for segment in name.split(".") if segment not in _WRAPPER_SEGMENTS)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_CLASSES) or "Norm" in type(module).__name__


def decays_by_default(module: nn.Module, parameter: nn.Parameter) -> bool:
    """Whether no_decay: auto leaves weight decay on: not for biases and other vectors, normalization layers or
    embeddings."""
    return parameter.dim() >= 2 and not _is_norm(module) and not isinstance(module, nn.Embedding)


def _named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Parameter]]:
    """(unwrapped name, holding module, parameter) of each parameter once."""
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for local_name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            yield unwrapped_name(f"{module_name}.{local_name}" if module_name else local_name), module, parameter


def param_groups(
    model: nn.Module, weight_decay: float, lr_scale_key: str, no_decay_auto: bool, rules: Sequence[GroupRule]
) -> list[dict[str, Any]]:
    """The optimizer's groups over model's parameters: each explicit rule's (a parameter joins the first that matches
    it), then the rest, split by no_decay: auto into those that decay and those that do not. Empty groups are left
    out (a pipeline stage may hold none of a group's parameters). Each group carries its LR's multiple under
    lr_scale_key, which the step's schedule applies."""
    explicit: list[list[nn.Parameter]] = [[] for _ in rules]
    decayed: list[nn.Parameter] = []
    undecayed: list[nn.Parameter] = []
    for name, module, parameter in _named_parameters(model):
        if not parameter.requires_grad:
            continue
        rule = next((i for i, r in enumerate(rules) if any(fnmatch.fnmatchcase(name, p) for p in r.patterns)), None)
        if rule is not None:
            explicit[rule].append(parameter)
        elif no_decay_auto and not decays_by_default(module, parameter):
            undecayed.append(parameter)
        else:
            decayed.append(parameter)
    groups = [
        {
            "params": parameters,
            "weight_decay": weight_decay if rule.weight_decay is None else rule.weight_decay,
            lr_scale_key: rule.lr_scale,
        }
        for rule, parameters in zip(rules, explicit, strict=True)
    ]
    groups.append({"params": decayed, "weight_decay": weight_decay, lr_scale_key: 1.0})
    groups.append({"params": undecayed, "weight_decay": 0.0, lr_scale_key: 1.0})
    return [group for group in groups if group["params"]]


def check_rules_match(model: nn.Module, rules: Sequence[GroupRule]) -> None:
    """Before the model is split or wrapped: each rule must select a parameter, or the job fails naming it (a pattern
    that matches nothing is a typo, which would otherwise train with the default settings unnoticed)."""
    names = [name for name, _, parameter in _named_parameters(model) if parameter.requires_grad]
    for index, rule in enumerate(rules):
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names for pattern in rule.patterns):
            examples = ", ".join(names[:4]) + (", …" if len(names) > 4 else "")
            raise JobInputError(
                f"train.optimizer.groups[{index}].params {list(rule.patterns)} match no trainable parameter of the "
                f"model, whose parameters are named like {examples}"
            )
