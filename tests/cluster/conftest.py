"""Every test in this folder needs a real Ray cluster: each is marked `integration` (pyproject.toml's markers), so
`pytest -m "not integration"` runs the rest of the suite without one.

Under `pytest -n` (the README's command) they form two xdist groups, each run one test after another in one worker:
the modules that build simulated clusters of their own (OWN_CLUSTERS: they kill nodes and heads), and the rest, which
share one Ray head (tests/conftest.py's shared_ray_head) or start a Ray of their own in the worker's process. They are
collected first (pyproject.toml's `--no-loadscope-reorder` hands work out in collection order), so on two workers
the two groups run side by side from the start, and each worker takes unit tests once its group ends.

Where the time went before (this machine, 2 cores): with one group, that group was the critical path (pytest 26:39),
its worker busy to the end while the other had run out of unit tests minutes before. A second group collected last,
taken by the worker that ran out of unit tests, did not help (31:21 against 30:11: it started only when the unit
tests ended). Three workers (two groups and the unit tests at once) saturated both cores from the middle of the run
on, and tests with time bounds failed (a GCS restart that took 103 s, a serve that took 12.7 s to stop, a 300 s
timeout): two streams of work at a time is what this machine holds."""

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
