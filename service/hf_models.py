"""What the control plane can know at submit about a ``model: hf:<ModelClass>`` without importing transformers (which
imports torch): whether the class exists in the installed transformers, and whether its config ships a
tensor-parallel plan. Read from transformers' source files, found without executing the package."""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HFModelFacts:
    config_class: str
    has_tp_plan: bool


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
        return HFModelFacts(config_class or "", _config_has_tp_plan(modeling.parent, config_class))
    return f"transformers has no model class {model_class!r}"


def _config_class_of(source: str, model_class: str) -> str | None:
    """The config class the modeling file's classes annotate ``config: XConfig`` with, or name in config_class."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(target, ast.Name) and target.id == "config_class"
                                                for target in node.targets) and isinstance(node.value, ast.Name):
            return node.value.id
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "config":
            if isinstance(node.annotation, ast.Name) and node.annotation.id.endswith("Config"):
                return node.annotation.id
    return None


def _config_has_tp_plan(folder: Path, config_class: str | None) -> bool:
    for configuration in folder.glob("configuration_*.py"):
        tree = ast.parse(configuration.read_text(encoding="utf-8", errors="replace"))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and (config_class is None or node.name == config_class):
                for statement in node.body:
                    targets = statement.targets if isinstance(statement, ast.Assign) else (
                        [statement.target] if isinstance(statement, ast.AnnAssign) else [])
                    if any(isinstance(target, ast.Name) and target.id == "base_model_tp_plan" for target in targets):
                        return isinstance(statement.value, ast.Dict) and bool(statement.value.keys)
    return False
