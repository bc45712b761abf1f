"""Known vulnerabilities in the locked dependencies: pip-audit over a lock, read strictly.

pip-audit prints "No known vulnerabilities found" and exits 0 even when it could audit nothing (a machine that cannot
reach PyPI's advisory data gets "Dependency not found on PyPI" for every package). So this reads its JSON: every
vulnerability not listed in audit-exceptions.txt fails the run, and packages that could not be audited are counted and
named, never passed over in silence. With `--require-audit` a lock that could not be audited whole fails too.

    python requirements/audit.py requirements/ci.txt [--require-audit]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

EXCEPTIONS = Path(__file__).with_name("audit-exceptions.txt")


def accepted(exceptions: Path) -> dict[str, str]:
    """Vulnerability id -> why it is accepted, from audit-exceptions.txt (`ID  reason`, # comments)."""
    found = {}
    for line in exceptions.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            vulnerability, _, reason = line.partition(" ")
            if not reason.strip():
                raise SystemExit(f"{exceptions.name}: {vulnerability} has no reason written beside it")
            found[vulnerability] = reason.strip()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lock", type=Path)
    parser.add_argument("--require-audit", action="store_true", help="fail when any package could not be audited")
    parser.add_argument("--exceptions", type=Path, default=EXCEPTIONS, help="the accepted vulnerabilities")
    args = parser.parse_args()
    exceptions = accepted(args.exceptions)
    with tempfile.TemporaryDirectory() as scratch:
        report_path = Path(scratch) / "audit.json"
        command = ["pip-audit", "-r", str(args.lock), "--no-deps", "--disable-pip", "--progress-spinner", "off"]
        command += ["-f", "json", "-o", str(report_path)]
        for vulnerability in exceptions:
            command += ["--ignore-vuln", vulnerability]
        ran = subprocess.run(command, capture_output=True, text=True)
        if not report_path.exists():
            print(f"pip-audit could not run (exit {ran.returncode}): {ran.stderr.strip()[-2000:]}", file=sys.stderr)
            return 1
        report = json.loads(report_path.read_text())
    dependencies = report["dependencies"]
    unaudited = [d["name"] for d in dependencies if "skip_reason" in d]
    vulnerable = [(d["name"], d["version"], v) for d in dependencies for v in d.get("vulns", [])]
    for name, version, vulnerability in vulnerable:
        print(
            f"{name} {version}: {vulnerability['id']} (fixed in {', '.join(vulnerability['fix_versions']) or 'none'})"
        )
    audited = len(dependencies) - len(unaudited)
    print(
        f"{args.lock}: {audited} of {len(dependencies)} packages audited, {len(vulnerable)} known vulnerabilities, "
        f"{len(exceptions)} accepted in {args.exceptions.name}"
    )
    if unaudited:
        print(
            f"NOT AUDITED ({len(unaudited)}): the advisory data could not be reached or has no record of "
            f"{', '.join(unaudited[:5])}{' …' if len(unaudited) > 5 else ''}"
        )
    if vulnerable or (args.require_audit and unaudited):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
