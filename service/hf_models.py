"""What the control plane can know at submit about a ``model: hf:<ModelClass>`` without importing transformers (which
imports torch): whether the class exists in the installed transformers, whether its config ships a tensor-parallel
plan, and which config field holds its context length, with that field's default. Read from transformers' source
files, found without executing the package."""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The name transformers gives a model's context length; a config may store it under another (its attribute_map:
# GPT-2's n_positions).
CONTEXT_LENGTH = "max_position_embeddings"


@dataclass(frozen=True)
class HFModelFacts:
    config_class: str
    has_tp_plan: bool
    context_field: str | None = None  # the config field of the context length (None: the config has none)
    context_default: int | None = None  # that field's default in the config class (None: not a literal there)


class UnknownHFModel(ValueError):
    pass


def hf_model_facts(model_class: str) -> HFModelFacts:
    """Raises UnknownHFModel, naming the cause, when transformers is missing or has no such class."""
    facts = _facts(model_class)
    if isinstance(facts, str):
        raise UnknownHFModel(facts)
    return facts


@functools.lru_cache(maxsize=256)
def _facts(model_class: str) -> HFModelFacts | str:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return "transformers is not installed where ringmaster runs: install ringmaster[hf]"
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    defined = re.compile(rf"^class {re.escape(model_class)}\(", re.MULTILINE)
    for modeling in sorted(models.glob("*/modeling_*.py")):
        source = modeling.read_text(encoding="utf-8", errors="replace")
        if not defined.search(source):
            continue
        config_class = _config_class_of(source, model_class)
        config = _config_node(modeling.parent, config_class)
        return HFModelFacts(config_class or "", _has_tp_plan(config), *_context_length(config))
    return f"transformers has no model class {model_class!r}"


def _config_class_of(source: str, model_class: str) -> str | None:
    """The config class the modeling file's classes annotate ``config: XConfig`` with, or name in config_class."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(target, ast.Name) and target.id == "config_class" for target in node.targets)
            and isinstance(node.value, ast.Name)
        ):
            return node.value.id
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "config"
            and isinstance(node.annotation, ast.Name)
            and node.annotation.id.endswith("Config")
        ):
            return node.annotation.id
    return None


def _config_node(folder: Path, config_class: str | None) -> ast.ClassDef | None:
    """The config class's definition in the model's folder (the first config class there when its name is unknown)."""
    for configuration in sorted(folder.glob("configuration_*.py")):
        tree = ast.parse(configuration.read_text(encoding="utf-8", errors="replace"))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and (config_class is None or node.name == config_class):
                return node
    return None


def _class_assignments(config: ast.ClassDef) -> dict[str, ast.expr | None]:
    """Name -> value of the class body's assignments (annotated ones without a value: None)."""
    assigned: dict[str, ast.expr | None] = {}
    for statement in config.body:
        if isinstance(statement, ast.Assign):
            assigned.update(
                (target.id, statement.value) for target in statement.targets if isinstance(target, ast.Name)
            )
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            assigned[statement.target.id] = statement.value
    return assigned


def _has_tp_plan(config: ast.ClassDef | None) -> bool:
    plan = _class_assignments(config).get("base_model_tp_plan") if config is not None else None
    return isinstance(plan, ast.Dict) and bool(plan.keys)


def _context_length(config: ast.ClassDef | None) -> tuple[str | None, int | None]:
    """The field holding the context length and its default: a class-level field (transformers' dataclass configs) or
    a keyword of ``__init__`` (older ones)."""
    if config is None:
        return None, None
    assigned = _class_assignments(config)
    field: object = CONTEXT_LENGTH  # an alias is whatever constant the map holds; one that is no string names no field
    aliases = assigned.get("attribute_map")
    if isinstance(aliases, ast.Dict):
        for key, value in zip(aliases.keys, aliases.values):
            if isinstance(key, ast.Constant) and key.value == CONTEXT_LENGTH and isinstance(value, ast.Constant):
                field = value.value
    defaults: dict[str, ast.expr | None] = dict(assigned)
    init = next((node for node in config.body if isinstance(node, ast.FunctionDef) and node.name == "__init__"), None)
    if init is not None:
        keywords = init.args.args[len(init.args.args) - len(init.args.defaults) :] + init.args.kwonlyargs
        values = list(init.args.defaults) + list(init.args.kw_defaults)
        defaults.update((argument.arg, value) for argument, value in zip(keywords, values))
    if not isinstance(field, str) or field not in defaults:
        return None, None
    return field, _integer(defaults[field])


_ARITHMETIC: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: int.__add__,
    ast.Sub: int.__sub__,
    ast.Mult: int.__mul__,
    ast.FloorDiv: int.__floordiv__,
    ast.Pow: int.__pow__,
}


def _integer(node: ast.expr | None) -> int | None:
    """An integer literal, or arithmetic on them (Mistral's ``4096 * 32``); None for anything else."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, int) and not isinstance(node.value, bool) else None
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _integer(node.left), _integer(node.right)
        if left is not None and right is not None and not (isinstance(node.op, ast.Pow) and right > 64):
            return _ARITHMETIC[type(node.op)](left, right)
    return None
