"""The commands on jobs, each through the REST API (service/client.py's RingmasterClient): submit, status, watch,
logs, cancel, tensorboard and export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
import yaml
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ringmaster.cli.failures import _fail, _handled
from ringmaster.cli.render import _STATE_STYLE, _print_job, _shown, _trimmed, console
from ringmaster.service.client import ApiError, RingmasterClient
from ringmaster.service.code_packing import CodeDirectoryError
from ringmaster.service.errors import CodeTooLarge
from ringmaster.service.naming import JOB_ID_LENGTH, TENSORBOARD_DIR
from ringmaster.service.planner import format_bytes
from ringmaster.service.settings import get_settings
from ringmaster.service.states import TERMINAL, JobState

ApiOption = Annotated[
    str | None, typer.Option("--api", help="API URL; default from RINGMASTER_API_URL / host and port.")
]


_PREFIX_MATCHES_SHOWN = 5


def _client(api: str | None) -> RingmasterClient:
    """A client with RINGMASTER_TOKEN, else the local admin token an embedded server wrote to the data directory."""
    return RingmasterClient.from_settings(get_settings(), api)


def _job_id(client: RingmasterClient, text: str) -> str:
    """A full job id, or an unambiguous prefix of one (as git and docker take them)."""
    text = text.strip().lower()
    if len(text) == JOB_ID_LENGTH:
        return text
    if not text or any(char not in "0123456789abcdef" for char in text):
        _fail(f"not a job id: {text!r} (ids are {JOB_ID_LENGTH} hex digits; any unambiguous prefix of one will do)")
    matches = client.jobs(id_prefix=text, limit=_PREFIX_MATCHES_SHOWN)
    if matches["total"] == 0:
        _fail(f"no job id starts with {text!r}")
    if matches["total"] > 1:
        shown = ", ".join(job["id"][:12] for job in matches["items"])
        more = (
            f" and {matches['total'] - len(matches['items'])} more" if matches["total"] > len(matches["items"]) else ""
        )
        _fail(f"{text!r} is ambiguous: {matches['total']} job ids start with it ({shown}{more}); give more of the id")
    return str(matches["items"][0]["id"])


@_handled
def submit(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Job spec, YAML or JSON.")],
    code: Annotated[
        Path | None,
        typer.Option(
            "--code",
            exists=True,
            file_okay=False,
            help="The job's own code: "
            "this directory is packed (minus .gitignore/.ringmasterignore matches) and shipped with the job; "
            "its modules are importable in the job's driver and workers.",
        ),
    ] = None,
    api: ApiOption = None,
) -> None:
    """Submit a job spec; prints the new job's id."""
    try:
        job = _client(api).submit_yaml(file.read_text(), code=code)
    except (CodeTooLarge, CodeDirectoryError, ValueError, yaml.YAMLError) as error:
        _fail(str(error))
    console.print(f"submitted [bold]{job['name']}[/bold] as job [bold]{job['id']}[/bold] ({job['state']})")
    print(job["id"])


@_handled
def status(
    job_id: Annotated[
        str | None, typer.Argument(help="A job id or an unambiguous prefix; without it, a table of jobs.")
    ] = None,
    api: ApiOption = None,
    state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
) -> None:
    """A table of jobs, or one job's details: its step of the total, loss, world size, recoveries and ETA."""
    client = _client(api)
    if job_id:
        _print_job(client.job(_job_id(client, job_id)))
        return
    rows = client.jobs(state=state)["items"]
    # Fits 80 columns: ids as short as `status ID` takes them, names and times trimmed.
    table = Table("id", "name", "state", "try", "created", box=None, padding=(0, 1))
    for job in rows:
        style = _STATE_STYLE.get(job["state"], "white")
        table.add_row(
            job["id"][:12],
            _trimmed(job["name"], 24),
            f"[{style}]{job['state']}[/{style}]",
            str(job["attempt"]),
            job["created_at"][:19].replace("T", " "),
        )
    console.print(table)


@_handled
def watch(
    job_id: str,
    api: ApiOption = None,
    every_s: Annotated[
        float,
        typer.Option(
            help="Without a terminal (a pipe, a CI log): a line at each state "
            "and at most this often while the job trains."
        ),
    ] = 10.0,
) -> None:
    """Live progress (step, loss, samples/s) until the job ends."""
    client = _client(api)
    job = _watch(client, _job_id(client, job_id), every_s)
    raise typer.Exit(code=0 if job["state"] == "SUCCEEDED" else 1)


def _watch(client: RingmasterClient, job_id: str, every_s: float = 10.0) -> dict[str, Any]:
    spec = client.job(job_id)["spec"]
    total = None if spec.get("command") else spec["train"]["steps"]  # a script job's own loop alone knows its steps
    if console.is_terminal:
        columns = [
            TextColumn("[bold]{task.fields[state]}"),
            BarColumn(),
            TextColumn("step {task.completed}" + ("" if total is None else "/{task.total}")),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("val {task.fields[val_loss]}"),
            TextColumn("{task.fields[speed]} samples/s"),
            TimeElapsedColumn(),
        ]
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("train", total=total, state="…", loss="-", val_loss="-", speed="-")
            for state, new_rows in _progress(client, job_id):
                progress.update(task, **_shown(state, new_rows))
    else:
        _watch_in_lines(client, job_id, total, every_s)
    job = client.job(job_id)
    style = _STATE_STYLE.get(job["state"], "white")
    console.print(f"job {job_id}: [{style}]{job['state']}[/{style}]")
    if job.get("error"):
        console.print(job["error"])
    return job


def _watch_in_lines(client: RingmasterClient, job_id: str, total: int | None, every_s: float) -> None:
    """Without a terminal a progress bar shows nothing until it ends: a plain line instead at each state, at most
    every `every_s` while steps arrive, and at the end."""
    fields: dict[str, Any] = {"state": "…", "completed": 0, "loss": "-", "val_loss": "-", "speed": "-"}
    printed, printed_at = None, float("-inf")
    of_total = "" if total is None else f"/{total}"

    def line() -> str:
        return (
            f"{fields['state']}  step {fields['completed']}{of_total}  loss {fields['loss']}  "
            f"val {fields['val_loss']}  {fields['speed']} samples/s"
        )

    for state, new_rows in _progress(client, job_id):
        state_changed = state is not None and state != fields["state"]
        fields.update(_shown(state, new_rows))
        if (state_changed or time.monotonic() - printed_at >= every_s) and line() != printed:
            printed, printed_at = line(), time.monotonic()
            console.print(printed, soft_wrap=True, highlight=False)
    fields["state"] = client.job(job_id)["state"]
    if line() != printed:
        console.print(line(), soft_wrap=True, highlight=False)


def _progress(client: RingmasterClient, job_id: str) -> Iterator[tuple[str | None, list[dict[str, Any]]]]:
    """(state or None, new metric rows) from the job's event stream; polling only if the stream cannot be opened."""
    started = False
    try:
        for message in client.stream(job_id):
            started = True
            if message["event"] == "state":
                yield message["data"]["to_state"], []
            elif message["event"] == "metric":
                yield None, [message["data"]]
        return
    except (ApiError, httpx.HTTPError):
        if started:
            raise
    for job, rows in client.follow(job_id):  # a server without the stream endpoint, or a proxy that refuses it
        yield job["state"], rows


@_handled
def logs(
    job_id: str,
    api: ApiOption = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the job ends.")] = False,
    interval_s: Annotated[float, typer.Option(help="With --follow, how often to look for new lines.")] = 1.0,
) -> None:
    """The job driver's log from Ray."""
    client = _client(api)
    job_id = _job_id(client, job_id)
    if not follow:
        text = client.logs(job_id)
        if text.strip():
            print(text)
        else:  # a driver that never started writes nothing: say so, and why where the job says
            job = client.job(job_id)
            ended = f"; the job ended {job['state']}: {job['error']}" if job.get("error") else ""
            print(f"job {job_id}'s attempt {job['attempt']} ({job['state']}) has no driver log{ended}", file=sys.stderr)
        return
    printed = ""
    while True:
        finished = JobState(client.job(job_id)["state"]) in TERMINAL
        try:
            text = client.logs(job_id)
        except ApiError as error:
            if error.status not in (409, 503):  # no log yet (not dispatched), or Ray cannot serve it now: look again
                raise
            text = printed
        # The log is the current attempt's: a new attempt starts a new one, printed from its start.
        new = text[len(printed) :] if text.startswith(printed) else text
        if new:
            print(new, end="" if new.endswith("\n") else "\n", flush=True)
        printed = text
        if finished:
            return
        time.sleep(interval_s)


@_handled
def cancel(job_id: str, api: ApiOption = None) -> None:
    """Cancel a job; its Ray job is stopped and its resources freed."""
    client = _client(api)
    job = client.cancel(_job_id(client, job_id))
    console.print(f"job {job['id']}: {job['state']}")


@_handled
def tensorboard(
    job_ids: Annotated[
        list[str] | None, typer.Argument(help="Jobs (ids or unambiguous prefixes); default: the newest 20.")
    ] = None,
    port: Annotated[int, typer.Option(help="TensorBoard's port.")] = 6006,
    api: ApiOption = None,
) -> None:
    """Start TensorBoard on jobs' event files (each job writes them under its storage: <storage>/<id>/tensorboard)."""
    client = _client(api)
    jobs = [client.job(_job_id(client, text)) for text in job_ids] if job_ids else client.jobs(limit=20)["items"]
    if not jobs:
        _fail("no jobs to show")
    storage = get_settings().resolved_storage_uri().rstrip("/")
    # One run per job, named after it; each attempt is a run below it.
    spec = ",".join(f"{job['name']}-{job['id'][:8]}:{storage}/{job['id']}/{TENSORBOARD_DIR}" for job in jobs)
    console.print(f"TensorBoard on {len(jobs)} job(s) at http://127.0.0.1:{port}/ (Ctrl-C ends it)")
    sys.stdout.flush()
    # This process becomes TensorBoard: a signal to it (Ctrl-C, a kill) reaches TensorBoard itself, leaving no child.
    os.execv(sys.executable, [sys.executable, "-m", "tensorboard.main", "--logdir_spec", spec, "--port", str(port)])


@_handled
def export(
    job_id: str,
    out: Annotated[Path, typer.Option("--out", help="A new (or empty) directory to write the model into.")],
    step: Annotated[int | None, typer.Option(help="The checkpoint's step; default: the newest.")] = None,
    api: ApiOption = None,
) -> None:
    """Write a job's checkpointed model weights as OUT/model.safetensors (an hf: model's config.json beside it), for
    plain PyTorch, transformers' from_pretrained or another job's model_options.pretrained. Reads the checkpoint from
    the job's storage, which must be reachable from here."""
    client = _client(api)
    job = client.job(_job_id(client, job_id))
    checkpoints = {checkpoint["step"]: checkpoint for checkpoint in client.checkpoints(job["id"])["items"]}
    if not checkpoints:
        _fail(
            f"job {job['id']} has no checkpoint on storage to export (checkpoint.every_steps saves them during "
            "training; every job that finishes saves a final one)"
        )
    chosen = checkpoints.get(max(checkpoints) if step is None else step)
    if chosen is None:
        _fail(
            f"job {job['id']} has no checkpoint at step {step}; it has steps {', '.join(map(str, sorted(checkpoints)))}"
        )
    command = [sys.executable, "-m", "ringmaster.workers.checkpoint.export", chosen["uri"], str(out)]
    model = job["spec"]["model"]
    if model.startswith("hf:"):
        command += [
            "--hf-class",
            model.removeprefix("hf:"),
            "--model-options",
            json.dumps(job["spec"].get("model_options") or {}),
        ]
    # Its own process: reading the checkpoint takes torch, which this command line never imports.
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or [f"the export ended with code {result.returncode}"]
        _fail(lines[-1].removeprefix("error: "))
    written = json.loads(result.stdout.strip().splitlines()[-1])
    files = ", ".join(Path(path).name for path in (written["weights"], written["config"]) if path)
    console.print(
        f"job {job['id']} step {chosen['step']}: {written['tensors']} tensors, "
        f"{format_bytes(written['parameter_bytes'])}, in {out} ({files})",
        soft_wrap=True,
    )
