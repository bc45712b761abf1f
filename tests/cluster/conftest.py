"""Every test in this folder needs a real Ray cluster: each is marked `integration` (pyproject.toml's markers), so
`pytest -m "not integration"` runs the rest of the suite without one. Under `pytest -n` they also share one xdist group,
so they run one after another in one worker (two Ray clusters at once would starve each other's heartbeats on a small
machine) while the other workers run the rest of the suite beside them."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
RAY_CLUSTER_GROUP = "ray-cluster"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the group mark into the scheduling group
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.xdist_group(RAY_CLUSTER_GROUP))
