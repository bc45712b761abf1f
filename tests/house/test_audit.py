"""requirements/audit.py reads pip-audit's report strictly: a vulnerability fails unless written down with its reason,
and packages that could not be audited are counted, never reported as clean. pip-audit itself needs PyPI's advisory
data, so here a stand-in with its command line and JSON report takes its place on PATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AUDIT = ROOT / "requirements" / "audit.py"

STAND_IN = """#!{python}
import json, sys
args = sys.argv[1:]
ignored = {{args[i + 1] for i, arg in enumerate(args) if arg == "--ignore-vuln"}}
report = json.loads({report!r})
for dependency in report["dependencies"]:
    dependency["vulns"] = [v for v in dependency.get("vulns", []) if v["id"] not in ignored]
open(args[args.index("-o") + 1], "w").write(json.dumps(report))
"""


def _audit(tmp_path: Path, dependencies: list[dict], *flags: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_in = bin_dir / "pip-audit"
    stand_in.write_text(STAND_IN.format(python=sys.executable, report=json.dumps({"dependencies": dependencies})))
    stand_in.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    lock = tmp_path / "lock.txt"
    lock.write_text("anything==1.0\n")
    return subprocess.run([sys.executable, str(AUDIT), str(lock), *flags], capture_output=True, text=True, env=env)


VULNERABLE = {"name": "somepkg", "version": "1.0", "vulns": [{"id": "GHSA-test-0001", "fix_versions": ["1.1"]}]}
CLEAN = {"name": "otherpkg", "version": "2.0", "vulns": []}
UNREACHABLE = {"name": "farpkg", "skip_reason": "Dependency not found on PyPI and could not be audited: farpkg (3.0)"}


def test_a_known_vulnerability_fails_and_is_named(tmp_path: Path) -> None:
    result = _audit(tmp_path, [VULNERABLE, CLEAN])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "somepkg 1.0: GHSA-test-0001 (fixed in 1.1)" in result.stdout
    assert "2 of 2 packages audited, 1 known vulnerabilities" in result.stdout


def test_an_accepted_vulnerability_passes_and_one_without_a_reason_is_refused(tmp_path: Path) -> None:
    exceptions = tmp_path / "exceptions.txt"
    exceptions.write_text("# accepted\nGHSA-test-0001  not reachable from ringmaster's use of somepkg\n")
    result = _audit(tmp_path, [VULNERABLE, CLEAN], "--exceptions", str(exceptions))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 known vulnerabilities, 1 accepted" in result.stdout
    exceptions.write_text("GHSA-test-0001\n")
    refused = _audit(tmp_path, [VULNERABLE, CLEAN], "--exceptions", str(exceptions))
    assert refused.returncode == 1 and "GHSA-test-0001 has no reason written beside it" in refused.stderr


def test_packages_that_could_not_be_audited_are_counted_not_passed_as_clean(tmp_path: Path) -> None:
    result = _audit(tmp_path, [CLEAN, UNREACHABLE])
    assert result.returncode == 0 and "1 of 2 packages audited" in result.stdout
    assert "NOT AUDITED (1)" in result.stdout and "farpkg" in result.stdout
    assert _audit(tmp_path, [CLEAN, UNREACHABLE], "--require-audit").returncode == 1
