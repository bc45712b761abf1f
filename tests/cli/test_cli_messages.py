"""The real `ringmaster` CLI, in a subprocess, against a real HTTP server: every expected failure is one clear line
and exit code 1, never a traceback; ids may be shortened; `status ID` says where training stands; tables fit 80
columns; `logs --follow` prints a log as it grows; `export` writes a checkpoint's weights."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn

from harness.ports import free_port
from ringmaster.api.app import create_app
from ringmaster.service import jobs
from ringmaster.service.db import session_scope
from ringmaster.service.models import Job, JobEvent, Metric, utcnow
from ringmaster.service.settings import Settings
from ringmaster.service.spec import JobSpec
from ringmaster.service.states import JobState

REPO_ROOT = Path(__file__).resolve().parents[2]
SPEC = {"name": "cli-job", "model": "mlp", "train": {"steps": 10, "global_batch_size": 8, "micro_batch_size": 4}}


@dataclass
class Server:
    url: str
    data_dir: Path
    app: object

    def sessions(self):
        return self.app.state.db.sessions


class _Logs:
    """The logs provider of the test server: a driver log that grows while a test watches it."""

    def __init__(self) -> None:
        self.text = ""

    def __call__(self, _submission_id: str) -> str:
        return self.text


@pytest.fixture(scope="module")
def logs() -> _Logs:
    return _Logs()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, logs: _Logs) -> Iterator[Server]:
    """The API on an embedded SQLite database (which writes its local admin token), with no cluster behind it."""
    data_dir = tmp_path_factory.mktemp("cli-server")
    settings = Settings(data_dir=data_dir, api_port=free_port())
    app = create_app(settings, logs_provider=logs)
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.api_port, log_level="warning"))
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uvicorn_server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the API server did not start"
        time.sleep(0.05)
    yield Server(settings.resolved_api_url(), data_dir, app)
    uvicorn_server.should_exit = True
    thread.join(timeout=10)


def ringmaster(*args: str, env: dict[str, str] | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess:
    """The CLI as a person runs it (a fresh process), with only the given RINGMASTER_* variables."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith("RINGMASTER_")}
    return subprocess.run(
        [sys.executable, "-m", "ringmaster.cli", *args],
        cwd=REPO_ROOT,
        text=True,
        capture_output=True,
        timeout=timeout_s,
        env={**clean, "COLUMNS": "80", **(env or {})},
    )


def at(server: Server) -> dict[str, str]:
    """Variables that point the CLI at the test server with its local admin token (found in the data directory)."""
    return {"RINGMASTER_API_URL": server.url, "RINGMASTER_DATA_DIR": str(server.data_dir)}


def one_line_failure(result: subprocess.CompletedProcess) -> str:
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 1, f"exit {result.returncode}: {output}"
    assert "Traceback" not in output, output
    assert len(output.splitlines()) == 1, f"more than one line:\n{output}"
    return output


def submitted(server: Server, count: int = 1) -> list[str]:
    with session_scope(server.sessions()) as session:
        return [
            jobs.submit_job(session, JobSpec.model_validate({**SPEC, "name": f"cli-job-{index}"})).id
            for index in range(count)
        ]


def test_a_server_that_is_not_there_is_named_with_what_to_do(tmp_path: Path) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    for verb in (
        ["status"],
        ["status", "0" * 32],
        ["watch", "0" * 32],
        ["logs", "0" * 32],
        ["cancel", "0" * 32],
        ["submit", str(REPO_ROOT / "examples" / "tiny-gpt.yaml")],
    ):
        line = one_line_failure(
            ringmaster(*verb, env={"RINGMASTER_API_URL": nowhere, "RINGMASTER_DATA_DIR": str(tmp_path)})
        )
        assert line == (
            f"error: cannot reach ringmaster at {nowhere} — is `ringmaster serve` running? "
            "set RINGMASTER_API_URL or --api"
        ), (verb, line)


def test_every_verb_answers_a_4xx_in_one_line(server: Server) -> None:
    unknown = "f" * 32
    for verb in ("status", "watch", "logs", "cancel"):
        line = one_line_failure(ringmaster(verb, unknown, env=at(server)))
        assert line == f"error: no job with id '{unknown}' (HTTP 404)", (verb, line)
    [job_id] = submitted(server)
    line = one_line_failure(ringmaster("logs", job_id, env=at(server)))
    assert line == f"error: job {job_id} has not been dispatched to Ray yet, so it has no logs (HTTP 409)"


def test_a_refused_token_names_where_it_came_from(server: Server, tmp_path: Path) -> None:
    line = one_line_failure(ringmaster("status", env={**at(server), "RINGMASTER_TOKEN": "rm_not-a-token"}))
    assert line.startswith("error: the API refused the token from RINGMASTER_TOKEN (")
    stale = tmp_path / "admin.token"
    stale.write_text("rm_a-token-from-another-server\n")
    line = one_line_failure(
        ringmaster("status", env={"RINGMASTER_API_URL": server.url, "RINGMASTER_DATA_DIR": str(tmp_path)})
    )
    assert line.startswith(f"error: the API refused the token from {stale.resolve()} (")


def test_the_cli_finds_the_local_server_where_it_said_it_listens(server: Server) -> None:
    submitted(server)
    (server.data_dir / "api-url").write_text(server.url + "\n")  # as `ringmaster serve` writes it
    try:
        found = ringmaster("status", env={"RINGMASTER_DATA_DIR": str(server.data_dir)})
    finally:
        (server.data_dir / "api-url").unlink()
    assert found.returncode == 0 and "cli-job-0" in found.stdout, found.stdout + found.stderr
    gone = one_line_failure(
        ringmaster("status", env={"RINGMASTER_DATA_DIR": str(server.data_dir), "RINGMASTER_API_PORT": str(free_port())})
    )
    assert gone.startswith("error: cannot reach ringmaster at http://127.0.0.1:"), "an explicit port wins over the file"


def test_an_unambiguous_id_prefix_is_taken_and_an_ambiguous_one_is_refused(server: Server) -> None:
    ids = submitted(server, 17)  # 17 ids: two of them share a first hex digit
    first_digits = [job_id[0] for job_id in ids]
    shared = next(digit for digit in first_digits if first_digits.count(digit) > 1)
    line = one_line_failure(ringmaster("status", shared, env=at(server)))
    assert line.startswith(f"error: '{shared}' is ambiguous: ") and line.endswith("give more of the id")
    target = ids[0]
    prefix = next(
        target[:length]
        for length in range(1, 33)
        if sum(other.startswith(target[:length]) for other in ids) == 1
        and not any(other.startswith(target[:length]) for other in _all_ids(server) if other != target)
    )
    shown = ringmaster("status", prefix, env=at(server))
    assert shown.returncode == 0 and f"job {target}" in shown.stdout, shown.stdout + shown.stderr
    line = one_line_failure(ringmaster("cancel", "0123456789abcdef0123456789abcde", env=at(server)))
    assert line == "error: no job id starts with '0123456789abcdef0123456789abcde'"
    line = one_line_failure(ringmaster("status", "not-hex", env=at(server)))
    assert line.startswith("error: not a job id: 'not-hex'")


def _all_ids(server: Server) -> list[str]:
    with session_scope(server.sessions()) as session:
        return [job.id for job in session.query(Job)]


def test_status_of_a_job_shows_step_loss_validation_world_size_recoveries_and_eta(server: Server) -> None:
    [job_id] = submitted(server)
    now = time.time()
    with session_scope(server.sessions()) as session:
        job = session.get(Job, job_id)
        job.state, job.attempt = JobState.RUNNING.value, 1
        session.add(
            JobEvent(job_id=job_id, at=utcnow(), kind="transition", from_state="RUNNING", to_state="RECOVERING")
        )
        # Four steps one second apart: six steps of ten are left, six seconds at this pace. Steps 2 and 3 were
        # validated: the newest validation is shown, with its step.
        for step in range(1, 5):
            session.add(
                Metric(
                    job_id=job_id,
                    attempt=1,
                    step=step,
                    loss=2.0 / step,
                    world_size=2,
                    samples_per_s=8.0,
                    wall_time=now - 4 + step,
                    val_loss=3.0 / step if step in (2, 3) else None,
                )
            )
    shown = ringmaster("status", job_id, env=at(server))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    # Longer than the 80 columns the CLI has without a terminal, and still one line (wrapped lines split values).
    assert (
        "step 4/10  loss 0.5000  val loss 1.0000 (step 3)  world size 2  recoveries 1  ETA 0m06s\n" in shown.stdout
    ), shown.stdout


def test_watch_shows_the_newest_loss_and_validation_loss(server: Server) -> None:
    [job_id] = submitted(server)
    with session_scope(server.sessions()) as session:
        job = session.get(Job, job_id)
        job.state, job.attempt = JobState.SUCCEEDED.value, 1
        for step in range(1, 5):
            session.add(
                Metric(
                    job_id=job_id,
                    attempt=1,
                    step=step,
                    loss=2.0 / step,
                    samples_per_s=8.0,
                    val_loss=3.0 / step if step in (2, 3) else None,
                )
            )
    shown = ringmaster("watch", job_id, env=at(server))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    # Without a terminal, plain lines; the last holds the job's final state and numbers.
    assert shown.stdout.splitlines()[-2:] == [
        "SUCCEEDED  step 4/10  loss 0.5000  val 1.0000  8.0 samples/s",
        f"job {job_id}: SUCCEEDED",
    ], shown.stdout


def test_watch_without_a_terminal_prints_a_line_at_each_state_and_as_steps_arrive(server: Server) -> None:
    [job_id] = submitted(server)
    with session_scope(server.sessions()) as session:
        job = session.get(Job, job_id)
        jobs.mark_admitted(session, job, 1, f"ringmaster-{job_id}-1", None, 2)
        jobs.transition(session, job, JobState.RUNNING, "training", {})
    watcher = subprocess.Popen(
        [sys.executable, "-m", "ringmaster.cli", "watch", job_id[:12], "--every-s", "0.2"],
        cwd=REPO_ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **at(server)},
    )
    try:
        assert [watcher.stdout.readline() for _ in range(3)] == [
            f"{state}  step 0/10  loss -  val -  - samples/s\n" for state in ("QUEUED", "ADMITTED", "RUNNING")
        ]
        with session_scope(server.sessions()) as session:
            session.add(Metric(job_id=job_id, attempt=1, step=1, loss=2.0, samples_per_s=8.0))
        assert watcher.stdout.readline() == "RUNNING  step 1/10  loss 2.0000  val -  8.0 samples/s\n"
        with session_scope(server.sessions()) as session:
            jobs.transition(session, session.get(Job, job_id), JobState.SUCCEEDED, "done", {})
        rest, errors = watcher.communicate(timeout=30)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, errors
    assert rest == f"SUCCEEDED  step 1/10  loss 2.0000  val -  8.0 samples/s\njob {job_id}: SUCCEEDED\n", rest


@pytest.mark.parametrize(
    ("loss", "shown"),
    [
        (2.86984, "2.8698"),
        (0.0, "0.0000"),
        (5.5695e30, "5.569e+30"),
        (3.2e-7, "3.2e-07"),
        (999999.0, "999999.0000"),
        (-0.5, "-0.5000"),
    ],
)
def test_a_loss_prints_with_four_decimals_unless_its_size_would_hide_it(loss: float, shown: str) -> None:
    from ringmaster.cli.render import _loss_text

    assert _loss_text(loss) == shown


def test_the_job_table_fits_80_columns(server: Server) -> None:
    with session_scope(server.sessions()) as session:
        jobs.submit_job(session, JobSpec.model_validate({**SPEC, "name": "a-job-name-that-goes-on-and-on-" + "x" * 32}))
    listed = ringmaster("status", env=at(server))
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert len(lines) > 2 and max(len(line) for line in lines) <= 80, listed.stdout


def test_an_invalid_spec_is_listed_one_field_a_line_each_named_once(server: Server, tmp_path: Path) -> None:
    unknown = "0" * 32
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: cli-bad\nmodel: mlp\nresume_from: '{unknown}'\ntrain: {{steps: 2, micro_batch_sz: 4}}\n")
    result = ringmaster("submit", str(spec), env=at(server))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    assert (result.stdout + result.stderr).strip().splitlines() == [
        "error: invalid job spec:",
        "  train.micro_batch_sz: Extra inputs are not permitted: did you mean 'micro_batch_size'?",
    ]
    spec.write_text(f"name: cli-bad\nmodel: mlp\nresume_from: '{unknown}'\n")
    result = ringmaster("submit", str(spec), env=at(server))
    assert (result.stdout + result.stderr).strip().splitlines() == [
        "error: invalid job spec:",
        f"  resume_from: no job with id '{unknown}'",
    ]
    # A message that is a sentence about its field names it once.
    spec.write_text("name: cli-bad\nmodel: mlp\nworkers: {min: 3, max: 2}\n")
    result = ringmaster("submit", str(spec), env=at(server))
    assert (result.stdout + result.stderr).strip().splitlines() == [
        "error: invalid job spec:",
        "  workers.min (3) must not exceed workers.max (2)",
    ]


def test_logs_of_a_job_whose_driver_never_started_say_so_and_why(server: Server, logs: _Logs) -> None:
    [job_id] = submitted(server)
    error = "attempt 1: the job's driver never started: its runtime env could not be set up: pip install failed: nope"
    with session_scope(server.sessions()) as session:
        job = session.get(Job, job_id)
        job.state, job.attempt, job.submission_id, job.error = JobState.FAILED.value, 1, f"ringmaster-{job_id}-1", error
    logs.text = ""
    result = ringmaster("logs", job_id[:12], env=at(server))
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr
    assert (
        result.stderr.strip() == f"job {job_id}'s attempt 1 (FAILED) has no driver log; the job ended FAILED: {error}"
    )


def test_logs_follow_prints_the_log_as_it_grows_until_the_job_ends(server: Server, logs: _Logs) -> None:
    [job_id] = submitted(server)
    with session_scope(server.sessions()) as session:
        job = session.get(Job, job_id)
        job.state, job.attempt, job.submission_id = JobState.RUNNING.value, 1, f"ringmaster-{job_id}-1"
    logs.text = "step 1 loss 2.0\n"
    follower = subprocess.Popen(
        [sys.executable, "-m", "ringmaster.cli", "logs", job_id[:12], "--follow", "--interval-s", "0.2"],
        cwd=REPO_ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **at(server)},
    )
    try:
        assert follower.stdout.readline() == "step 1 loss 2.0\n"
        logs.text += "step 2 loss 1.0\n"
        assert follower.stdout.readline() == "step 2 loss 1.0\n"
        logs.text += "job ended\n"
        with session_scope(server.sessions()) as session:
            session.get(Job, job_id).state = JobState.SUCCEEDED.value
        rest, errors = follower.communicate(timeout=30)
    finally:
        follower.kill()
    assert follower.returncode == 0, errors
    assert rest == "job ended\n", rest


def test_tensorboard_serves_the_jobs_event_files(server: Server) -> None:
    import httpx

    from ringmaster.service.reports import MetricPoint
    from ringmaster.workers.driver.training_log import TensorBoardEvents

    [job_id] = submitted(server)
    events = TensorBoardEvents(str(server.data_dir / "checkpoints" / job_id / "tensorboard" / "attempt-1"))
    events.points(
        [MetricPoint(step=step, loss=1.0 / step, lr=0.01, world_size=2, wall_time=time.time()) for step in range(1, 4)],
        recoveries=0,
    )
    events.close()
    port = free_port()
    board = subprocess.Popen(
        [sys.executable, "-m", "ringmaster.cli", "tensorboard", job_id[:10], "--port", str(port)],
        cwd=REPO_ROOT,
        env={**os.environ, **at(server)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert board.poll() is None, board.communicate()[1][-2000:]
            try:
                tags = httpx.get(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=2).json()
                if tags:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, "TensorBoard did not serve the job's runs"
            time.sleep(0.5)
        run = f"cli-job-0-{job_id[:8]}/attempt-1"
        assert run in tags and {"train/loss", "train/lr", "train/world_size", "train/recoveries"} <= set(tags[run]), (
            tags
        )
        scalars = httpx.get(
            f"http://127.0.0.1:{port}/data/plugin/scalars/scalars", params={"run": run, "tag": "train/loss"}, timeout=5
        ).json()
        assert [(step, round(value, 6)) for _, step, value in scalars] == [(1, 1.0), (2, 0.5), (3, round(1 / 3, 6))]
    finally:
        board.terminate()
        board.wait(timeout=30)
    assert not any(f"--port {port}" in _command_line(pid) for pid in os.listdir("/proc") if pid.isdigit()), (
        "TensorBoard outlived the command that started it"
    )


def _command_line(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # it ended meanwhile
        return ""


def _train_one_rank(rank: int, world_size: int, storage: str) -> None:
    import torch

    from harness.sinks import CallbackSink
    from ringmaster.workers.trainer import TrainContext, run_training

    spec = JobSpec.model_validate(
        {**SPEC, "train": {**SPEC["train"], "steps": 2}, "checkpoint": {"every_steps": 1, "keep": 2}}
    )
    run_training(spec, TrainContext(rank, world_size, torch.device("cpu"), "cli-export", storage, sink=CallbackSink()))


def test_export_writes_a_checkpoints_weights_and_refuses_in_one_line_what_it_cannot(
    server: Server, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    from harness.checkpoints import load_model_weights, usable_checkpoints
    from harness.process_group import run_on_ranks
    from ringmaster.service.models import Checkpoint
    from ringmaster.workers.models import build_bundle

    run_on_ranks(_train_one_rank, 1, str(tmp_path / "storage"))
    saved = {checkpoint.step: checkpoint.path for checkpoint in usable_checkpoints(tmp_path / "storage")}
    assert sorted(saved) == [1, 2]
    job_id, bare_job_id = submitted(server, 2)
    with session_scope(server.sessions()) as session:
        session.get(Job, job_id).state = JobState.SUCCEEDED.value
        for step, path in saved.items():
            session.add(
                Checkpoint(
                    job_id=job_id,
                    attempt=1,
                    step=step,
                    uri=path,
                    world_size=1,
                    final=step == 2,
                    created_at=utcnow(),
                    best=False,
                )
            )

    exported = ringmaster("export", job_id[:10], "--out", str(tmp_path / "newest"), env=at(server))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert exported.stdout.startswith(f"job {job_id} step 2: ") and exported.stdout.endswith(
        f"in {tmp_path / 'newest'} (model.safetensors)\n"
    ), exported.stdout
    weights = load_file(tmp_path / "newest" / "model.safetensors")
    trained = build_bundle(JobSpec.model_validate(SPEC)).model
    load_model_weights(saved[2], trained)
    assert set(weights) == set(trained.state_dict())
    assert all(torch.equal(weights[name], tensor) for name, tensor in trained.state_dict().items())

    assert ringmaster("export", job_id, "--out", str(tmp_path / "first"), "--step", "1", env=at(server)).returncode == 0
    assert not torch.equal(
        load_file(tmp_path / "first" / "model.safetensors")["output.weight"], weights["output.weight"]
    )

    assert one_line_failure(ringmaster("export", job_id, "--out", str(tmp_path / "newest"), env=at(server))) == (
        f"error: {tmp_path / 'newest'} already exists and is not an empty directory: give a new one"
    )
    assert one_line_failure(
        ringmaster("export", job_id, "--out", str(tmp_path / "x"), "--step", "7", env=at(server))
    ) == (f"error: job {job_id} has no checkpoint at step 7; it has steps 1, 2")
    assert one_line_failure(ringmaster("export", bare_job_id, "--out", str(tmp_path / "y"), env=at(server))).startswith(
        f"error: job {bare_job_id} has no checkpoint on storage to export"
    )
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
