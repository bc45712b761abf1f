"""Shared fixtures: an in-process one-rank gloo group for tests that need collectives but not peers,
and the databases every control-plane test runs on (SQLite, and PostgreSQL in a fresh schema)."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from sqlalchemy import Engine, create_engine

from harness.ports import free_port
from ringmaster.service.db import Database, upgrade_schema

POSTGRES_ENV = "RINGMASTER_TEST_POSTGRES_URL"
# Under `pytest -n` the Ray cluster tests run one after another in one worker: the run's critical path. The worker
# that runs the unit tests beside them does so at this lower CPU priority (and so does every process it starts), so
# the cluster tests' bursts of work (a job's ranks starting, each importing torch) take the cores first, and the unit
# tests, which have time to spare, run on what the cluster tests leave.
UNIT_TEST_NICENESS = 10
# Where the kernel groups CPU time by session (autogroup, Linux's default on desktops and this CI's machine), a nice
# value weighs only against processes of the same session: each Ray process that starts a session of its own (a
# job's training process among them) gets as large a share as the whole of pytest's session, niced or not. So each
# worker takes a session of its own, and the niceness is set on its autogroup as well.
AUTOGROUP = "/proc/self/autogroup"

# The CLI's rich console takes its width from COLUMNS when it is first imported and keeps it; the CLI tests give the
# width they read in each call's environment. An ambient one (an xdist worker starts with COLUMNS=80 and LINES=24, a
# plain run with neither) would make them pass or fail by which test imported the CLI first.
for _terminal_size in ("COLUMNS", "LINES"):
    os.environ.pop(_terminal_size, None)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return  # one process runs everything: nothing to give way to
    # The thread that runs the tests (niceness is a thread's on Linux): the processes and threads it starts inherit it.
    wanted = 0 if item.get_closest_marker("integration") else UNIT_TEST_NICENESS
    if os.getpriority(os.PRIO_PROCESS, 0) != wanted:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, wanted)
        except PermissionError:
            pass  # back to a higher priority needs root: a worker that ran unit tests first keeps the lower one
    _set_autogroup_niceness(wanted)


def _set_autogroup_niceness(wanted: int) -> None:
    if not os.path.exists(AUTOGROUP):
        return  # a kernel without autogroups weighs the thread's niceness alone
    if os.getsid(0) != os.getpid():
        try:
            os.setsid()  # at the first test, before the worker has started any process: all of them join its autogroup
        except PermissionError:
            return  # a process group's leader cannot: its autogroup is pytest's, not its own to renice
    with open(AUTOGROUP) as autogroup:
        current = int(autogroup.read().split()[-1])  # "/autogroup-25 nice 10"
    if current != wanted:
        try:
            with open(AUTOGROUP, "w") as autogroup:
                autogroup.write(str(wanted))
        except PermissionError:
            pass  # as above: back to a higher priority needs root


@pytest.fixture
def single_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _postgres_admin_url() -> str:
    """The server to create test schemas on; missing is a skip locally but a failure in CI."""
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        message = f"{POSTGRES_ENV} is not set (e.g. postgresql+psycopg://user:password@127.0.0.1:5432/postgres)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL tests must run in CI: {message}")
        pytest.skip(message)
    return url


@pytest.fixture(scope="session")
def postgres_admin() -> Iterator[Engine]:
    engine = create_engine(_postgres_admin_url(), isolation_level="AUTOCOMMIT")
    yield engine
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An empty database: a SQLite file, or a fresh PostgreSQL schema (much cheaper than CREATE DATABASE)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db') / 'ringmaster.db'}"
        return
    admin: Engine = request.getfixturevalue("postgres_admin")
    schema = f"test_{uuid.uuid4().hex[:12]}"
    with admin.connect() as connection:
        connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        url = admin.url.update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    upgrade_schema(db_url)
    database = Database.connect(db_url)
    yield database
    database.dispose()


@pytest.fixture(scope="session")
def shared_ray_head(tmp_path_factory: pytest.TempPathFactory):
    """One Ray head for the session's control planes (starting one takes ~13 s); each control plane leaves it as it
    found it (harness.local_control_plane.clear_head). Modules that kill nodes or heads build clusters of their own."""
    from harness.local_control_plane import start_test_head, stop_test_head

    head = start_test_head(tmp_path_factory.mktemp("shared-ray"))
    yield head
    stop_test_head(head)


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory: pytest.TempPathFactory, shared_ray_head):
    """A control plane on the shared Ray head for a module's tests that run jobs on Ray. One per module, torn down
    at its end, so no module finds this process connected to another module's control plane."""
    from harness.local_control_plane import running_control_plane

    yield from running_control_plane(tmp_path_factory.mktemp("ringmaster"), head=shared_ray_head)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A Ray of the module's own in this process (no control plane), for tests of actors by themselves."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module", autouse=True)
def _no_ray_connection_outlives_its_module() -> Iterator[None]:
    """Every module starts disconnected from Ray, whatever the module before it connected to (its own cluster's
    fixtures disconnect first; this also ends a connection a test made and left)."""
    yield
    if "ray" in sys.modules:
        from harness.local_control_plane import leave_ray

        leave_ray()


@pytest.fixture
def client(ray_server):
    return ray_server.client()


_finished_sessions: list[pytest.Session] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    _finished_sessions.append(session)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Once pytest has reported, a process that joined Ray ends without the interpreter's finalisation. It has joined
    and left many clusters; Ray's core worker threads can call into a finalising interpreter, and so (once in a few
    CI runs, after every test had passed) the process crashed at exit (ray-project/ray#31145 is of that kind)."""
    if _finished_sessions and "ray" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(_finished_sessions[-1].exitstatus))
