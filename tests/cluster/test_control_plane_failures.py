"""The control plane survives its own failures: real `ringmaster serve` processes on a real Ray head.

- the server is killed with SIGKILL mid-job and started again: the running Ray job is adopted, the
  job finishes once, and the driver's buffered reports are replayed without duplicates;
- the job's driver process is killed: the reconciler resubmits it as attempt 2, which resumes from
  the latest committed checkpoint and succeeds;
- PostgreSQL restarts mid-job: no event, metric or state transition is lost;
- the whole Ray cluster is killed mid-job and a new one started at its address: the server lives on, joins the
  new cluster by itself, and the job resumes there from its newest checkpoint and succeeds;
- with GCS fault tolerance (Redis), the head alone is killed and restarted mid-job: the workers and the driver,
  off the head, train on, and the job succeeds as attempt 1 with every step once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy import Engine, text

from harness.fault_tolerant_cluster import DRIVER_RESOURCE, FaultTolerantCluster, redis_server_path
from harness.local_control_plane import CLUSTER_CPUS, REPO_ROOT, jobs_api
from harness.ports import free_port
from ringmaster.service import auth
from ringmaster.service.client import ApiError, RingmasterClient
from ringmaster.service.db import Database, session_scope, upgrade_schema
from ringmaster.service.embedded_ray import RayHead, start_head, stop_head
from ringmaster.service.models import DEFAULT_TENANT
from ringmaster.workers.checkpoint.durable import committed_checkpoints
from tests.support.paced_model import hold, release

pytestmark = pytest.mark.integration

# Each training step sleeps this long while the job's hold file exists (tests/support/paced_model.py), so the job is
# still training when the failure strikes; the test releases it once the failure is over, and the rest runs unpaced.
PAUSE_S = 0.1
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def _spec(name: str, steps: int, every_steps: int, hold_file: str) -> dict:
    return {
        "name": name,
        "model": "tests.support.paced_model:build",
        "model_options": {"pause_s": PAUSE_S, "n_val": 64, "hold_file": hold_file},
        "workers": {"min": 2, "max": 2, "cpus_per_worker": 1},
        "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 4, "lr": 0.01},
        # keep everything: the resume test reads which checkpoints attempt 1 committed
        "checkpoint": {"every_steps": every_steps, "keep": 100},
        "max_failures": 2,
    }


@dataclass
class Server:
    """`ringmaster serve` in its own process, on a fixed port and database, against the shared Ray head."""

    data_dir: Path
    database_url: str
    head: RayHead
    port: int
    token: str | None = None
    process: subprocess.Popen | None = None
    settings: dict[str, str] = field(default_factory=dict)  # more RINGMASTER_* variables

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        if self.token is None:
            self.token = _mint_admin_token(self.database_url)
        env = dict(
            os.environ,
            RINGMASTER_DATA_DIR=str(self.data_dir),
            RINGMASTER_DATABASE_URL=self.database_url,
            RINGMASTER_RAY_ADDRESS=self.head.gcs_address,
            RINGMASTER_RAY_DASHBOARD_URL=self.head.dashboard_url,
            RINGMASTER_RAY_AUTH_TOKEN_FILE=self.head.auth_token_path or "",
            RINGMASTER_API_PORT=str(self.port),
            RINGMASTER_DRIVER_PYTHON=sys.executable,
            RINGMASTER_CODE_PATH=str(REPO_ROOT),
            **self.settings,
        )
        with open(self.data_dir / "server.log", "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ringmaster.cli", "serve"],
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 90
        client = api(self)
        try:
            while not client.healthy():
                assert self.process.poll() is None, (
                    f"the server exited with {self.process.returncode} (Ray head alive: {self.head.alive()}):\n"
                    f"{self.log_tail()}"
                )
                assert time.monotonic() < deadline, (
                    f"the server did not answer within 90 s (Ray head alive: {self.head.alive()}):\n{self.log_tail()}"
                )
                time.sleep(0.2)
        finally:
            client.close()
        return self

    def replacement(self) -> Server:
        """A new server on this one's port, database and token (not started)."""
        return Server(self.data_dir, self.database_url, self.head, self.port, self.token, settings=self.settings)

    def kill(self) -> None:
        """kill -9: no shutdown code runs."""
        assert self.process is not None and self.process.poll() is None, "the server is not running"
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def log_tail(self, chars: int = 4000) -> str:
        path = self.data_dir / "server.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def api(server: Server) -> RingmasterClient:
    """The one place the tests build their API client, with the server's admin token."""
    return RingmasterClient(server.url, token=server.token, timeout_s=10)


def _mint_admin_token(database_url: str) -> str:
    """An admin token written straight into the database (migrated first), as `ringmaster token create --admin` does."""
    upgrade_schema(database_url)
    database = Database.connect(database_url)
    try:
        with session_scope(database.sessions) as session:
            return auth.create_token(
                session, DEFAULT_TENANT, admin=True, description="control-plane failure tests"
            ).secret
    finally:
        database.dispose()


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    head = start_head(tmp_path_factory.mktemp("failures-ray"), num_cpus=CLUSTER_CPUS)
    try:
        yield head
    finally:
        stop_head(head)


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    """Every server a test starts is stopped afterwards, whatever happened."""
    started: list[Server] = []
    yield started
    for server in started:
        server.stop()


def _sqlite_server(tmp_path: Path, head: RayHead, servers: list[Server]) -> Server:
    server = Server(tmp_path, f"sqlite:///{tmp_path / 'ringmaster.db'}", head, free_port())
    servers.append(server)
    return server


def _poll(
    client: RingmasterClient, job_id: str, until: Callable[[dict], object], timeout_s: float, server: Server
) -> dict:
    """The job once until(job) holds; API errors while the control plane is down or restarting are waited out."""
    deadline = time.monotonic() + timeout_s
    job: dict = {}
    while True:
        assert server.process is None or server.process.poll() is None, (
            f"the server exited with {server.process.returncode}:\n{server.log_tail()}"
        )
        try:
            job = client.job(job_id)
            if until(job):
                return job
        except (ApiError, httpx.HTTPError) as error:
            if isinstance(error, ApiError) and error.status < 500:
                raise
        assert time.monotonic() < deadline, (
            f"job {job_id} is {job.get('state')} after {timeout_s} s:\n{server.log_tail()}"
        )
        time.sleep(0.25)


def _ended_or_second_attempt_running(job: dict) -> bool:
    return job["state"] in TERMINAL or (job["attempt"], job["state"]) == (2, "RUNNING")


def _first_metrics(client: RingmasterClient, job_id: str, timeout_s: float, server: Server) -> None:
    _poll(client, job_id, lambda job: job["state"] == "RUNNING" and client.metrics(job_id)["items"], timeout_s, server)


def _transitions(client: RingmasterClient, job_id: str) -> list[tuple[str | None, str]]:
    return [(event["from_state"], event["to_state"]) for event in client.events(job_id)["items"] if event["to_state"]]


def _ray_jobs(head: RayHead, job_id: str) -> dict[str, str]:
    """Every Ray job this job ever had, by submission id, with its status."""
    listed = jobs_api(head).list_jobs()
    return {
        job.submission_id: str(job.status.value)
        for job in listed
        if job.submission_id and job.submission_id.startswith(f"ringmaster-{job_id}-")
    }


def _wait_ray_status(head: RayHead, submission_id: str, status: str, timeout_s: float = 30) -> None:
    ray_jobs = jobs_api(head)
    deadline = time.monotonic() + timeout_s
    while (current := str(ray_jobs.get_job_status(submission_id).value)) != status:
        assert time.monotonic() < deadline, f"Ray job {submission_id} is {current}, not {status}"
        time.sleep(0.25)


def _assert_every_step_once(rows: list[dict], steps: range) -> None:
    counts = Counter(row["step"] for row in rows)
    missing = sorted(set(steps) - set(counts))
    doubled = sorted(step for step, times in counts.items() if times > 1)
    assert not missing and not doubled and set(counts) == set(steps), (
        f"steps missing: {missing}, stored twice: {doubled}"
    )


def test_server_killed_mid_job_restarts_and_the_job_finishes_once(tmp_path, ray_head, servers):
    steps = 200
    first = _sqlite_server(tmp_path, ray_head, servers).start()
    client = api(first)
    held = hold(tmp_path / "hold")
    job = client.submit(_spec("kill-server", steps=steps, every_steps=50, hold_file=held))
    _first_metrics(client, job["id"], 90, first)
    first.kill()
    time.sleep(2.0)  # the driver keeps training and buffers its reports meanwhile
    submission_id = f"ringmaster-{job['id']}-1"
    ray_jobs = jobs_api(ray_head)

    second = first.replacement()
    servers.append(second)
    second.start()
    # The point of the test: the new server finds the Ray job still running and must adopt it.
    assert str(ray_jobs.get_job_status(submission_id).value) == "RUNNING", "the job ended before the restart"
    release(held)
    done = _poll(client, job["id"], lambda j: j["state"] in TERMINAL, 90, second)

    assert done["state"] == "SUCCEEDED", done["error"]
    assert (done["attempt"], done["failures"]) == (1, 0)
    assert _transitions(client, job["id"]) == [
        (None, "QUEUED"),
        ("QUEUED", "ADMITTED"),
        ("ADMITTED", "RUNNING"),
        ("RUNNING", "SUCCEEDED"),
    ]
    rows = client.metrics(job["id"])["items"]
    _assert_every_step_once(rows, range(1, steps + 1))
    assert {row["attempt"] for row in rows} == {1}
    assert [c["step"] for c in client.checkpoints(job["id"])["items"]] == [50, 100, 150, 200]
    _wait_ray_status(ray_head, submission_id, "SUCCEEDED")
    assert _ray_jobs(ray_head, job["id"]) == {submission_id: "SUCCEEDED"}, "exactly one Ray job for the one attempt"
    assert "control plane unreachable" in ray_jobs.get_job_logs(submission_id), "the driver never had to buffer"


def test_killed_driver_is_resubmitted_and_resumes_from_its_checkpoint(tmp_path, ray_head, servers):
    steps, every = 100, 10
    server = _sqlite_server(tmp_path, ray_head, servers).start()
    client = api(server)
    held = hold(tmp_path / "hold")
    job = client.submit(_spec("kill-driver", steps=steps, every_steps=every, hold_file=held))
    job_id = job["id"]
    _poll(client, job_id, lambda j: j["state"] == "RUNNING" and client.checkpoints(job_id)["items"], 90, server)
    seen_checkpoint = max(c["step"] for c in client.checkpoints(job_id)["items"])
    assert seen_checkpoint < steps, "the job finished before its driver could be killed"

    first_attempt = f"ringmaster-{job_id}-1"
    driver = jobs_api(ray_head).get_job_info(first_attempt).driver_info
    assert driver is not None and driver.pid, "Ray does not know the driver's process"
    command_line = Path(f"/proc/{driver.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert "ringmaster.workers.driver" in command_line and job_id in command_line, command_line
    os.kill(int(driver.pid), signal.SIGKILL)
    # Attempt 1's ranks, paced, cannot outrun their driver's death to a later checkpoint; attempt 2 runs unpaced.
    _poll(client, job_id, _ended_or_second_attempt_running, 120, server)
    release(held)

    done = _poll(client, job_id, lambda j: j["state"] in TERMINAL, 120, server)
    assert done["state"] == "SUCCEEDED", done["error"]
    assert (done["attempt"], done["failures"]) == (2, 1)
    events = client.events(job_id)["items"]
    assert [(e["from_state"], e["to_state"]) for e in events if e["to_state"]] == [
        (None, "QUEUED"),
        ("QUEUED", "ADMITTED"),
        ("ADMITTED", "RUNNING"),
        ("RUNNING", "QUEUED"),
        ("QUEUED", "ADMITTED"),
        ("ADMITTED", "RUNNING"),
        ("RUNNING", "SUCCEEDED"),
    ]
    requeued = next(e for e in events if e["to_state"] == "QUEUED" and e["from_state"])
    assert requeued["message"].startswith(
        f"attempt 1: Ray job {first_attempt} ended FAILED without the driver reporting; resubmitting"
    ), requeued["message"]

    rows = client.metrics(job_id)["items"]
    second = sorted(row["step"] for row in rows if row["attempt"] == 2)
    resumed_from = second[0] - 1
    # Attempt 2 started right after a checkpoint attempt 1 committed: the newest one before it began.
    attempt_one_checkpoints = [
        c.step for c in committed_checkpoints(tmp_path / "checkpoints" / job_id) if c.step < second[0]
    ]
    assert resumed_from >= seen_checkpoint > 0
    assert resumed_from == max(attempt_one_checkpoints), (resumed_from, attempt_one_checkpoints)
    assert second == list(range(resumed_from + 1, steps + 1)), "attempt 2 ran a step twice or skipped one"
    first_steps = {row["step"] for row in rows if row["attempt"] == 1}
    assert set(range(1, resumed_from + 1)) <= first_steps, "attempt 1 did not report every step it committed"
    _wait_ray_status(ray_head, f"ringmaster-{job_id}-2", "SUCCEEDED")
    assert _ray_jobs(ray_head, job_id) == {first_attempt: "FAILED", f"ringmaster-{job_id}-2": "SUCCEEDED"}


def test_a_replaced_ray_cluster_is_joined_by_the_living_server_and_the_job_resumes_there(tmp_path, servers):
    steps, every = 100, 10
    heads = [start_head(tmp_path / "ray-1", num_cpus=CLUSTER_CPUS)]
    try:
        server = _sqlite_server(tmp_path, heads[0], servers).start()
        client = api(server)
        held = hold(tmp_path / "hold")
        job_id = client.submit(_spec("cluster-replaced", steps=steps, every_steps=every, hold_file=held))["id"]
        _poll(client, job_id, lambda j: j["state"] == "RUNNING" and client.checkpoints(job_id)["items"], 90, server)
        seen_checkpoint = max(c["step"] for c in client.checkpoints(job_id)["items"])
        assert seen_checkpoint < steps, "the job finished before its cluster could be killed"

        stop_head(heads[0], grace_s=0.0)  # every process of the cluster: GCS, raylet, the driver, the workers
        time.sleep(3.0)  # the control plane meets a cluster that is gone
        assert server.process.poll() is None, f"the server died with its cluster:\n{server.log_tail()}"
        heads.append(
            start_head(
                tmp_path / "ray-1",  # its token too, as a replaced KubeRay cluster keeps its Secret
                num_cpus=CLUSTER_CPUS,
                port=int(heads[0].gcs_address.rsplit(":", 1)[1]),
                dashboard_port=urlsplit(heads[0].dashboard_url).port,
            )
        )
        assert heads[1].gcs_address == heads[0].gcs_address and heads[1].dashboard_url == heads[0].dashboard_url

        _poll(client, job_id, _ended_or_second_attempt_running, 180, server)
        release(held)  # attempt 2, on the new cluster, runs unpaced
        done = _poll(client, job_id, lambda j: j["state"] in TERMINAL, 180, server)  # checks the server is alive
        assert done["state"] == "SUCCEEDED", done["error"]
        assert (done["attempt"], done["failures"]) == (2, 1)
        requeued = next(e for e in client.events(job_id)["items"] if e["to_state"] == "QUEUED" and e["from_state"])
        assert requeued["message"].startswith(
            f"attempt 1: Ray job ringmaster-{job_id}-1 is gone from Ray; resubmitting"
        ), requeued["message"]
        rows = client.metrics(job_id)["items"]
        second = sorted(row["step"] for row in rows if row["attempt"] == 2)
        assert second[0] - 1 >= seen_checkpoint, (
            "attempt 2 did not resume from the newest checkpoint attempt 1 committed"
        )
        assert second == list(range(second[0], steps + 1))
        # The second cluster ran it, through an agent of the server's that joined it (the first one's was lost).
        _wait_ray_status(heads[1], f"ringmaster-{job_id}-2", "SUCCEEDED")
        assert _ray_jobs(heads[1], job_id) == {f"ringmaster-{job_id}-2": "SUCCEEDED"}
        assert "Ray agent 2 (pid" in server.log_tail(200_000), server.log_tail()
        assert server.process.poll() is None
    finally:
        for head in heads:
            stop_head(head, grace_s=2.0)


@pytest.fixture
def fault_tolerant_cluster(tmp_path: Path) -> Iterator[FaultTolerantCluster]:
    if redis_server_path() is None:
        message = "redis-server is needed for GCS fault tolerance (apt-get install redis-server)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    cluster = FaultTolerantCluster(tmp_path / "cluster")
    try:
        yield cluster
    finally:
        cluster.shutdown()


def test_with_gcs_fault_tolerance_a_head_restart_leaves_the_job_training_as_attempt_1(
    tmp_path, servers, fault_tolerant_cluster
):
    cluster = fault_tolerant_cluster
    # 50 s paced: the head is down and back well within it (a loaded machine's restart has taken over 25 s); released
    # once the job has trained on after the head came back.
    steps, trained_after_restart = 500, 20
    server = Server(
        tmp_path,
        f"sqlite:///{tmp_path / 'ringmaster.db'}",
        cluster.head,
        free_port(),
        settings={
            "RINGMASTER_DRIVER_RESOURCES": json.dumps({DRIVER_RESOURCE: 1}),
            "RINGMASTER_WARM_WORKERS_PER_NODE": "0",
        },
    )
    servers.append(server)
    server.start()
    client = api(server)
    held = hold(tmp_path / "hold")
    job_id = client.submit(_spec("head-restart", steps=steps, every_steps=0, hold_file=held))["id"]
    _poll(client, job_id, lambda j: j["state"] == "RUNNING" and len(client.metrics(job_id)["items"]) >= 20, 90, server)
    driver = jobs_api(cluster.head).get_job_info(f"ringmaster-{job_id}-1").driver_info
    assert driver is not None and driver.pid

    killed_at, back_at = cluster.restart_head()
    assert server.process.poll() is None, f"the server died with the head:\n{server.log_tail()}"
    _poll(
        client,
        job_id,
        lambda j: (
            j["state"] in TERMINAL
            or sum(row["wall_time"] > back_at for row in client.metrics(job_id)["items"]) >= trained_after_restart
        ),
        120,
        server,
    )
    release(held)
    done = _poll(client, job_id, lambda j: j["state"] in TERMINAL, 180, server)  # checks the server is alive

    assert done["state"] == "SUCCEEDED", done["error"]
    assert (done["attempt"], done["failures"]) == (1, 0), (
        "the job was restarted instead of living through the head's restart"
    )
    assert _transitions(client, job_id) == [
        (None, "QUEUED"),
        ("QUEUED", "ADMITTED"),
        ("ADMITTED", "RUNNING"),
        ("RUNNING", "SUCCEEDED"),
    ]
    rows = client.metrics(job_id)["items"]
    _assert_every_step_once(rows, range(1, steps + 1))  # no step redone, none skipped
    finished = [row["wall_time"] for row in rows if row["loss"] is not None]
    assert any(killed_at < at < back_at for at in finished), "no step was trained while the head was down"
    assert any(at > back_at for at in finished), (
        f"the job had finished before the head came back (the restart took {back_at - killed_at:.1f} s)"
    )
    assert server.process.poll() is None


@dataclass(frozen=True)
class OwnPostgres:
    """A PostgreSQL cluster of the test's own (Debian's pg_createcluster, as root in CI), so that restarting it leaves
    the server every other test uses alone: under `pytest -n`, those run at the same time."""

    version: str
    name: str
    url: str

    def pg_ctlcluster(self, action: str) -> None:
        result = subprocess.run(
            ["pg_ctlcluster", self.version, self.name, action], capture_output=True, text=True, timeout=90, check=False
        )
        assert result.returncode == 0, (
            f"pg_ctlcluster {self.version} {self.name} {action}: {result.stdout}{result.stderr}"
        )


@pytest.fixture
def own_postgres(postgres_admin: Engine) -> Iterator[OwnPostgres]:
    """A new cluster of the shared server's PostgreSQL version, on a free loopback port, trusting local connections
    (it holds nothing but this test's schema), dropped afterwards."""
    with postgres_admin.connect() as connection:
        version = connection.execute(text("SHOW server_version_num")).scalar_one()[:-4]
    name, port = f"restart_{uuid.uuid4().hex[:8]}", free_port()
    created = subprocess.run(
        ["pg_createcluster", version, name, "--port", str(port), "--start", "--", "--auth=trust"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert created.returncode == 0, f"pg_createcluster {version} {name}: {created.stdout}{created.stderr}"
    try:
        yield OwnPostgres(version, name, f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres")
    finally:
        subprocess.run(["pg_dropcluster", "--stop", version, name], capture_output=True, timeout=120, check=False)


def _restart_postgres(postgres: OwnPostgres) -> None:
    """Down for a couple of seconds, as in a failover: a restart alone can fall between two of the driver's reports."""
    postgres.pg_ctlcluster("stop")
    time.sleep(2.0)
    postgres.pg_ctlcluster("start")


@pytest.mark.postgres
def test_postgres_restart_mid_job_loses_nothing(tmp_path, ray_head, servers, own_postgres):
    steps, every = 150, 25
    server = Server(tmp_path, own_postgres.url, ray_head, free_port())
    servers.append(server)
    server.start()
    client = api(server)
    held = hold(tmp_path / "hold")
    job = client.submit(_spec("restart-postgres", steps=steps, every_steps=every, hold_file=held))
    job_id = job["id"]
    _first_metrics(client, job_id, 90, server)
    _restart_postgres(own_postgres)
    submission_id = f"ringmaster-{job_id}-1"
    assert str(jobs_api(ray_head).get_job_status(submission_id).value) == "RUNNING", (
        "the job ended before PostgreSQL came back"
    )
    release(held)

    done = _poll(client, job_id, lambda j: j["state"] in TERMINAL, 90, server)
    assert done["state"] == "SUCCEEDED", done["error"]
    assert (done["attempt"], done["failures"]) == (1, 0)
    assert _transitions(client, job_id) == [
        (None, "QUEUED"),
        ("QUEUED", "ADMITTED"),
        ("ADMITTED", "RUNNING"),
        ("RUNNING", "SUCCEEDED"),
    ]
    rows = client.metrics(job_id)["items"]
    _assert_every_step_once(rows, range(1, steps + 1))
    assert all(row["loss"] is not None for row in rows)
    checkpoint_steps = list(range(every, steps + 1, every))
    assert [c["step"] for c in client.checkpoints(job_id)["items"]] == checkpoint_steps
    announced = [e["data"]["step"] for e in client.events(job_id)["items"] if e["kind"] == "checkpoint"]
    assert announced == checkpoint_steps, "a checkpoint event is missing or doubled"
    # The dispatcher loop outlived the restart: it still closes the finished attempt.
    _poll(
        client,
        job_id,
        lambda _: any(e["message"] == "attempt 1 closed: SUCCEEDED" for e in client.events(job_id)["items"]),
        60,
        server,
    )
    assert server.process is not None and server.process.poll() is None, "the server died with the database"
    logs = jobs_api(ray_head).get_job_logs(submission_id)
    assert "control plane answered 503" in logs or "control plane unreachable" in logs, (
        "no report met the restart: the test did not exercise it"
    )
