"""Every test in this folder needs a real Ray cluster: each is marked `integration` (pyproject.toml's markers), so
`pytest -m "not integration"` runs the rest of the suite without one."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)
