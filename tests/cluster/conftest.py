"""Every test in this folder needs a real Ray cluster: each is marked `integration` (pyproject.toml's markers), so
`pytest -m "not integration"` runs the rest of the suite without one.

Under `pytest -n` (the README's command) they form two xdist groups, each run one test after another in one worker:
the modules on the session's shared Ray head (the larger group), collected first so that it starts at once, and the
modules that build and kill simulated clusters of their own (OWN_CLUSTER_MODULES), collected last. The other workers
run the rest of the suite beside the first group, and whichever of them runs out of work first takes the second, so
the cores are not left idle while the shared head's group ends alone (pyproject.toml's `--no-loadscope-reorder`
hands work out in collection order). Both groups at once from the start were slower on a 2-core machine: two Ray
clusters and their training competed for the same cores while the unit tests waited."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
RAY_CLUSTER_GROUP = "ray-cluster"
OWN_CLUSTERS_GROUP = "ray-own-clusters"
# Modules whose fixtures start a simulated multi-node cluster of their own (harness.simulated_cluster), never the
# shared head: about a sixth of the cluster tests' time, moved beside the unit tests' tail.
OWN_CLUSTER_MODULES = frozenset({"test_elastic.py"})


def _order(item: pytest.Item) -> int:
    """0: the shared head's group, first; 1: the rest of the suite; 2: the own-cluster group, last."""
    if HERE not in item.path.parents:
        return 1
    return 2 if item.path.name in OWN_CLUSTER_MODULES else 0


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the group mark into the scheduling group
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)
            group = OWN_CLUSTERS_GROUP if item.path.name in OWN_CLUSTER_MODULES else RAY_CLUSTER_GROUP
            item.add_marker(pytest.mark.xdist_group(group))
    # A stable sort: each module's tests stay together and in their order (module fixtures are set up once).
    items.sort(key=_order)
