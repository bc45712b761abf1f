"""Every test in this folder needs a real Ray cluster: each is marked `integration` (pyproject.toml's markers), so
`pytest -m "not integration"` runs the rest of the suite without one.

Under `pytest -n` (the README's command) they form two xdist groups, each run one test after another in one worker,
while the other workers run the rest of the suite beside them: the modules that build simulated clusters of their own
(OWN_CLUSTERS: they kill nodes and heads), and the rest, which share one Ray head (tests/conftest.py's
shared_ray_head) or start a Ray of their own in the worker's process. They are collected first (pyproject.toml's
`--no-loadscope-reorder` hands work out in collection order), so both groups, the longest parts, start at once.

Why two groups and three workers on a 2-core machine (tests/conftest.py's pytest_xdist_auto_num_workers): one group
was the run's critical path (26:39 of pytest on this machine, its worker busy to the end while the other had run out
of unit tests long before). A test on a simulated cluster keeps about one core busy, and the whole run about 1.4 of
the two (sampled from /proc while it ran), so a third stream of work fits beside the two. Two groups on two workers
were measured before, the second collected last and taken by the worker that ran out of unit tests: that did not
help (31:21 against 30:11), since the second group then started only when the unit tests ended."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
RAY_CLUSTER_GROUP = "ray-cluster"
OWN_CLUSTERS_GROUP = "ray-own-clusters"
OWN_CLUSTERS = {"test_elastic.py", "test_memory_recovery_on_ray.py", "test_control_plane_failures.py"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the group mark into the scheduling group
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)
            group = OWN_CLUSTERS_GROUP if item.path.name in OWN_CLUSTERS else RAY_CLUSTER_GROUP
            item.add_marker(pytest.mark.xdist_group(group))
    # A stable sort: each module's tests stay together and in their order (module fixtures are set up once).
    items.sort(key=lambda item: HERE not in item.path.parents)
