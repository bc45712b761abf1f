"""The lock files (requirements/) satisfy what pyproject.toml asks for: a dependency added or narrowed there without
regenerating the locks fails here, not in CI's install or the container build."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
LOCKED_EXTRAS = {"ci.txt": ("test", "dev", "hf", "mlflow", "s3", "docs"), "runtime.txt": ()}


def _pins(lock: str) -> dict[str, str]:
    pins = {}
    for line in (REPO_ROOT / "requirements" / lock).read_text().splitlines():
        if match := re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line):
            pins[canonicalize_name(match[1])] = match[2]
    return pins


@pytest.mark.parametrize("lock", sorted(LOCKED_EXTRAS))
def test_every_requirement_is_locked_at_a_version_it_allows(lock: str) -> None:
    pins = _pins(lock)
    wanted = [*PYPROJECT["dependencies"]]
    for extra in LOCKED_EXTRAS[lock]:
        wanted += PYPROJECT["optional-dependencies"][extra]
    for text in wanted:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name == "torch":  # installed apart, CPU or CUDA build (requirements/README.md)
            assert name not in pins
            continue
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        assert name in pins, f"{lock} does not pin {name}: regenerate it (requirements/README.md)"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{lock} pins {name}=={pins[name]}, outside pyproject.toml's {requirement.specifier}"
        )


def test_the_runtime_lock_agrees_with_the_ci_lock() -> None:
    ci, runtime = _pins("ci.txt"), _pins("runtime.txt")
    assert {name: version for name, version in runtime.items() if ci.get(name) != version} == {}
