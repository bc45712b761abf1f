"""The rooms' import rules (pyproject.toml's [tool.importlinter] contracts) and ringmaster's one import name."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold() -> None:
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports is not None, "import-linter is part of the test extra: pip install -e '.[test]'"
    result = subprocess.run([lint_imports, "--no-cache"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_every_package_folder_installs_under_the_ringmaster_name() -> None:
    """A package folder missing from pyproject.toml's list would work in an editable checkout and be absent from
    the wheel (the container image)."""
    setuptools = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        f"ringmaster.{'.'.join(init.parent.relative_to(REPO_ROOT).parts)}"
        for room in setuptools["package-dir"].values()
        for init in (REPO_ROOT / room).rglob("__init__.py")
    }
    assert folders == set(setuptools["packages"])
    assert all(name.startswith("ringmaster.") for name in setuptools["package-dir"])
