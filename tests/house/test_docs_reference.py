"""The documentation site (docs/, built by mkdocs.yml) names every field a job spec accepts, at any depth (issue 13:
"the JobSpec reference lists every new field with its default"), and every setting's environment variable: one added
without a word in the reference fails here. The site builds with no broken link or anchor (`mkdocs build --strict`)
and loads no asset from another host, so it works on an offline cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from ringmaster.service.settings import Settings
from ringmaster.service.spec import JobSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = REPO_ROOT / "docs"
JOB_PAGES = sorted((DOCS / "jobs").glob("*.md"))  # the JobSpec reference: the spec, then a page per subject
SETTINGS_PAGE = DOCS / "operations" / "settings.md"
MKDOCS = Path(sys.executable).parent / "mkdocs"


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


def test_every_job_spec_field_is_named_in_the_job_reference():
    assert DOCS / "jobs" / "spec.md" in JOB_PAGES, JOB_PAGES
    text = "\n".join(page.read_text() for page in JOB_PAGES)
    paths = _field_paths(JobSpec)
    assert len(paths) > 40, paths  # the walk reached the nested specs (train, checkpoint, data sources, …)
    missing = [path for path, name in paths if not re.search(rf"\b{re.escape(name)}\b", text)]
    assert not missing, f"JobSpec fields docs/jobs/ never names: {missing}"


def test_every_setting_is_named_on_the_settings_page():
    text = SETTINGS_PAGE.read_text()
    prefix = Settings.model_config["env_prefix"]
    assert prefix == "RINGMASTER_"
    missing = [f"{prefix}{name}".upper() for name in Settings.model_fields if f"{prefix}{name}".upper() not in text]
    assert not missing, f"settings {SETTINGS_PAGE.relative_to(REPO_ROOT)} never names: {missing}"


# What a page would fetch from another host: a script, a stylesheet, font or icon (<link href>), an image, a CSS
# @import or url() (web fonts among them), and Google Fonts by name wherever it appears.
_EXTERNAL_ASSET = {
    ".html": re.compile(
        r"<script\b[^>]*\bsrc=[\"']?(?:https?:)?//"
        r"|<link\b(?=[^>]*\brel=[\"']?(?:stylesheet|preload|preconnect|modulepreload|icon))[^>]*\bhref=[\"']?(?:https?:)?//"
        r"|<img\b[^>]*\bsrc=[\"']?(?:https?:)?//"
        r"|@import\s+(?:url\()?[\"']?(?:https?:)?//"
        r"|url\(\s*[\"']?(?:https?:)?//"
        r"|fonts\.(?:googleapis|gstatic)\.com",
        re.IGNORECASE,
    ),
    ".css": re.compile(
        r"@import\s+(?:url\()?[\"']?(?:https?:)?//|url\(\s*[\"']?(?:https?:)?//|fonts\.(?:googleapis|gstatic)\.com",
        re.IGNORECASE,
    ),
    ".js": re.compile(r"@import\s+(?:url\()?[\"']?(?:https?:)?//|fonts\.(?:googleapis|gstatic)\.com", re.IGNORECASE),
}


def test_the_site_builds_strictly_and_loads_nothing_from_another_host(tmp_path: Path) -> None:
    if not MKDOCS.exists():
        message = f"no mkdocs beside {sys.executable}: pip install -e '.[docs]'"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    site = tmp_path / "site"
    build = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--config-file", str(REPO_ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, build.stdout + build.stderr
    pages = sorted(site.rglob("*.html"))
    assert site / "jobs" / "spec.html" in pages, pages
    found = []
    for path in sorted(site.rglob("*")):
        pattern = _EXTERNAL_ASSET.get(path.suffix)
        if pattern is None:
            continue
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(site)}: {match[0]}" for match in pattern.finditer(text)]
        if path.suffix == ".html":
            # Material's bundle loads mermaid from a CDN for a mermaid diagram, and asks GitHub's API for a repository
            # widget (repo_url): neither may appear on a page.
            found += [f"{path.relative_to(site)}: a mermaid diagram" for _ in re.finditer(r"class=\"mermaid", text)]
            found += [f"{path.relative_to(site)}: a repository widget" for _ in re.finditer(r"md-source", text)]
    assert not found, "the site loads from another host:\n" + "\n".join(found)
    # Search works from disk: the offline plugin inlines the index into a script.
    assert (site / "search" / "search_index.js").is_file()
