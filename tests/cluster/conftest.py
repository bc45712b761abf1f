"""Every test in this folder needs a real Ray cluster: each is marked `integration` (pyproject.toml's markers), so
`pytest -m "not integration"` runs the rest of the suite without one.

Under `pytest -n` (the README's command) they form one xdist group, run one after another in one worker, while the
other workers run the rest of the suite beside them. They are collected first (pyproject.toml's
`--no-loadscope-reorder` hands work out in collection order), so the group, the longest part, starts at once. Two
groups of them at once were slower on a 2-core machine, not faster: two Ray clusters and their training compete for
the same cores (28 min 42 s for the whole CI against 27 min 29 s with one group). Measured again with the modules
that build their own simulated clusters (test_elastic.py) as a second group collected last, taken by the worker
that ran out of unit tests: the shared head's group, the run's critical path, slowed by as much as the second group
saved (its slowest tests 30-60 % slower than in the run before; the run took 31 min 21 s against 30 min 11 s, with
about 100 more tests, one of them a 65 s cluster test): the machine's cores are busy throughout, so only less work
shortens the run.

Measured again this way (pytest 26:39 on one group): the two groups side by side from the start on two workers, the
unit tests after them, were no faster (both groups still ran at 1,057 s, against 1,600 s for the one group alone,
before a single unit test had run) and a control-plane failure test (a replaced Ray cluster) failed beside the other
group; three workers (two groups and the unit tests at once) saturated both cores from mid-run (pytest 36:34 on a
machine other work also loaded) with three time-bounded tests failing (a GCS restart of 103 s, a serve that took
12.7 s to stop, schemathesis past 300 s).

With the unit tests' worker at a lower CPU priority (tests/conftest.py) and the control-plane failure tests paced only
until their failure is over, the one group ended at 1,566 s against 1,679 s, the unit tests at 1,313 s against 940 s
(pytest 26:25, the whole CI 27:42, against 28:08 and 29:22). Sampled from /proc each second, the processes at normal
priority (the group's) kept 0.5-0.8 of the two cores busy throughout, the unit tests the rest: the run is now bound by
the CPU work of the whole suite, not by the group's waits.

Then, with the unit tests' ranks forked from a server that imported torch once (harness/process_group.py) and each
worker in a session of its own whose autogroup carries its niceness (tests/conftest.py), on a machine where the run
before took pytest 31:50 (the group ending at 1,897 s, the unit tests at 1,811 s): pytest 27:40, the group ending at
1,614 s and the unit tests at 1,645 s. Four shared-head modules moved to a second group collected after the unit
tests ran alone at the end instead (xdist handed it to the worker that finished this group first): 200 s more."""

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
    # A stable sort: each module's tests stay together and in their order (module fixtures are set up once).
    items.sort(key=lambda item: HERE not in item.path.parents)
