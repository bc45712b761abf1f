"""Every test in this folder needs a real Ray cluster: each is marked `integration` (pyproject.toml's markers), so
`pytest -m "not integration"` runs the rest of the suite without one.

Under `pytest -n` (the README's command) they run in two xdist groups, each one test after another in one worker:
RECOVERY, the tests that kill nodes, processes, heads and servers and time how the system answers, starts first and
runs beside the rest of the suite; RESULTS, the end-to-end results through REST (numerics, user code, storage, the web
view, what a safe default exposes), is collected last, so it goes to a worker once the other tests are done and runs
beside the end of RECOVERY. The two take about as long (CI-like runs on this 2-core machine).
pyproject.toml's `--dist loadgroup --no-loadscope-reorder` keeps that order."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
RECOVERY = "ray-cluster-recovery"
RESULTS = "ray-cluster-results"
RESULTS_MODULES = {
    "test_checkpoint_storage.py",
    "test_data_sources_on_ray.py",
    "test_hf_on_ray.py",
    "test_job_code_on_ray.py",
    "test_ray_secrets.py",
    "test_resume_from.py",
    "test_safe_defaults.py",
    "test_strategies_on_ray.py",
    "test_user_code_names.py",
    "test_web_ui.py",
}


def _group(item: pytest.Item) -> str | None:
    if HERE not in item.path.parents:
        return None
    return RESULTS if item.path.name in RESULTS_MODULES else RECOVERY


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the group mark into the scheduling group
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if (group := _group(item)) is not None:
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.xdist_group(group))
    # A stable sort: each module's tests stay together and in their order (module fixtures are set up once).
    order = {RECOVERY: 0, None: 1, RESULTS: 2}
    items.sort(key=lambda item: order[_group(item)])
