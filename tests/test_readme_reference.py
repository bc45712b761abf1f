"""The README names every field a job spec accepts, at any depth (issue 13: "the JobSpec reference lists every new
field with its default"), and every setting's environment variable: one added without a word in the README fails here."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from ringmaster.service.settings import Settings
from ringmaster.service.spec import JobSpec

README = Path(__file__).resolve().parents[1] / "README.md"


def _field_paths(model: type[BaseModel], prefix: str = "", seen: set[type] | None = None) -> list[tuple[str, str]]:
    """(dotted path, field name) of every field of `model` and of the models its fields hold."""
    seen = set() if seen is None else seen
    paths = []
    for name, field in model.model_fields.items():
        paths.append((f"{prefix}{name}", name))
        stack = [field.annotation]
        while stack:
            annotation = stack.pop()
            stack.extend(typing.get_args(annotation))
            if isinstance(annotation, type) and issubclass(annotation, BaseModel) and annotation not in seen:
                seen.add(annotation)
                paths += _field_paths(annotation, f"{prefix}{name}.", seen)
    return paths


def test_every_job_spec_field_is_named_in_the_readme():
    text = README.read_text()
    paths = _field_paths(JobSpec)
    assert len(paths) > 40, paths  # the walk reached the nested specs (train, checkpoint, data sources, …)
    missing = [path for path, name in paths if not re.search(rf"\b{re.escape(name)}\b", text)]
    assert not missing, f"JobSpec fields the README never names: {missing}"


def test_every_setting_is_named_in_the_readme():
    text = README.read_text()
    prefix = Settings.model_config["env_prefix"]
    assert prefix == "RINGMASTER_"
    missing = [f"{prefix}{name}".upper() for name in Settings.model_fields if f"{prefix}{name}".upper() not in text]
    assert not missing, f"settings the README never names: {missing}"
