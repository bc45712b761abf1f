"""The rooms' import rules (pyproject.toml's [tool.importlinter] contracts) and ringmaster's one import name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


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
    source_root = REPO_ROOT / setuptools["package-dir"][""]
    folders = {
        ".".join(Path(folder).relative_to(source_root).parts)
        for folder, _, files in os.walk(source_root / "ringmaster", followlinks=True)
        if "__init__.py" in files
    }
    assert folders == set(setuptools["packages"])
    assert {"ringmaster.api", "ringmaster.service", "ringmaster.workers"} <= folders


def test_the_installed_names_link_to_the_top_level_rooms() -> None:
    """src/ringmaster's links are what editors and type checkers follow from a ringmaster.* import to its file."""
    for room in ("api", "service", "workers", "cli"):
        link = REPO_ROOT / "src" / "ringmaster" / room
        assert link.is_symlink() and link.resolve() == REPO_ROOT / room, link


def test_an_editor_resolves_a_ringmaster_import_to_its_file(tmp_path: Path) -> None:
    """What a jedi-based editor does in a user's own project with ringmaster installed as the README says:
    go-to-definition reaches the source file and completion lists the module's names (an import hook, which
    static tools never run, left both empty)."""
    import jedi

    project = jedi.Project(tmp_path)
    script = jedi.Script(
        "from ringmaster.service.spec import JobSpec\nJobSpec\n", path=tmp_path / "use.py", project=project
    )
    [definition] = script.goto(2, 3, follow_imports=True)
    assert definition.module_path is not None
    assert Path(definition.module_path).resolve() == REPO_ROOT / "service" / "spec.py"
    assert definition.name == "JobSpec" and definition.type == "class"
    completion = jedi.Script(
        "import ringmaster.workers.trainer.trainer as t\nt.", path=tmp_path / "use.py", project=project
    )
    assert "Trainer" in {name.name for name in completion.complete(2, 2)}
