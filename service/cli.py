"""The `ringmaster` command line: serve, submit, status, watch, logs, cancel, export, plan, demo; db, token and tenant
administration."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import httpx
import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ringmaster.service.client import ApiError, RingmasterClient, TokenRefused
from ringmaster.service.code_packing import CodeDirectoryError
from ringmaster.service.embedded_ray import HeadStartFailed
from ringmaster.service.errors import CodeTooLarge
from ringmaster.service.naming import JOB_ID_LENGTH, TENSORBOARD_DIR
from ringmaster.service.planner import GB, format_bytes, format_duration
from ringmaster.service.settings import get_settings
from ringmaster.service.states import TERMINAL, JobState

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

app = typer.Typer(help="ringmaster: elastic distributed training as a service.", no_args_is_help=True)
db_app = typer.Typer(help="Database administration.", no_args_is_help=True)
token_app = typer.Typer(
    help="API tokens, made and revoked directly in the database (RINGMASTER_DATABASE_URL).", no_args_is_help=True
)
tenant_app = typer.Typer(
    help="Tenants and their quotas, directly in the database (RINGMASTER_DATABASE_URL).", no_args_is_help=True
)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")
app.add_typer(tenant_app, name="tenant")
console = Console()

ApiOption = Annotated[
    str | None, typer.Option("--api", help="API URL; default from RINGMASTER_API_URL / host and port.")
]
_PREFIX_MATCHES_SHOWN = 5
_STATE_STYLE = {
    "SUCCEEDED": "green",
    "FAILED": "red",
    "CANCELLED": "yellow",
    "RUNNING": "cyan",
    "ADMITTED": "blue",
    "QUEUED": "white",
}


def _client(api: str | None) -> RingmasterClient:
    """A client with RINGMASTER_TOKEN, else the local admin token an embedded server wrote to the data directory."""
    return RingmasterClient.from_settings(get_settings(), api)


def _fail(message: str) -> None:
    # Unwrapped, and the message's own brackets (paths, a spec's text) printed as they are, not read as markup.
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code=1)


def _unreachable(error: httpx.TransportError) -> str:
    try:
        url = error.request.url
        where = f"{url.scheme}://{url.netloc.decode()}"
    except RuntimeError:  # an error raised before a request existed
        where = get_settings().client_api_url()
    if isinstance(error, httpx.TimeoutException):
        return f"ringmaster at {where} did not answer in time ({type(error).__name__})"
    return f"cannot reach ringmaster at {where} — is `ringmaster serve` running? set RINGMASTER_API_URL or --api"


def _handled(command):
    """The expected failures of a command that calls the API end it with one line and exit code 1, never a
    traceback: the server unreachable, a refused token (naming where it came from), any 4xx/5xx answer."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except TokenRefused as error:
            _fail(
                f"the API refused the token from {error.source} ({error.detail}); set RINGMASTER_TOKEN to a token "
                "from `ringmaster token create`, or run the server on embedded defaults, which writes a local "
                "admin token this command picks up"
            )
        except ApiError as error:
            _fail(_describe(error))
        except httpx.TransportError as error:
            _fail(_unreachable(error))
        except HeadStartFailed as error:
            _fail(str(error))

    return run


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
    return matches["items"][0]["id"]


@app.command()
def serve(
    port: Annotated[int | None, typer.Option(help="API port (RINGMASTER_API_PORT).")] = None,
    host: Annotated[str | None, typer.Option(help="API host (RINGMASTER_API_HOST).")] = None,
) -> None:
    """Run the API server and the dispatcher (and an embedded Ray head unless RINGMASTER_RAY_ADDRESS is set)."""
    from ringmaster.api.server import (
        run_server,
    )  # the composition root lives with the API, which may import the service

    overrides = {key: value for key, value in {"api_port": port, "api_host": host}.items() if value is not None}
    try:
        run_server(get_settings().model_copy(update=overrides))
    except HeadStartFailed as error:
        _fail(str(error))


@app.command()
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


@app.command()
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


def _trimmed(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _loss_text(loss: float) -> str:
    """Four decimals as losses usually read; four significant digits where that would print a diverging loss's 30
    digits, or 0.0000 for a tiny one."""
    return f"{loss:.4f}" if loss == 0 or 1e-3 <= abs(loss) < 1e6 else f"{loss:.4g}"


def _print_job(job: dict[str, Any]) -> None:
    style = _STATE_STYLE.get(job["state"], "white")
    progress = job["progress"]
    console.print(
        f"job [bold]{job['id']}[/bold] {escape(job['name'])}: [{style}]{job['state']}[/{style}] "
        f"(attempt {job['attempt']}, tenant {escape(job['tenant'])})",
        soft_wrap=True,
    )
    parts = [f"step {progress['step']}/{progress['total_steps']}"]
    if progress["loss"] is not None:
        parts.append(f"loss {_loss_text(progress['loss'])}")
    if progress["val_loss"] is not None:
        parts.append(f"val loss {_loss_text(progress['val_loss'])} (step {progress['val_step']})")
    if progress["world_size"] is not None:
        parts.append(f"world size {progress['world_size']}")
    parts.append(f"recoveries {progress['recoveries']}")
    if progress["eta_s"] is not None:
        parts.append(f"ETA {format_duration(progress['eta_s'])}")
    # Unwrapped: a line cut at the terminal's width would split a value (a timestamp) in two.
    console.print("  ".join(parts), soft_wrap=True)
    times = [
        f"{label} {job[field][:19].replace('T', ' ')}"
        for label, field in (("created", "created_at"), ("started", "started_at"), ("finished", "finished_at"))
        if job.get(field)
    ]
    console.print("  ".join(times), soft_wrap=True)
    if job.get("waiting_reason"):
        console.print(f"waiting: {escape(job['waiting_reason'])}", soft_wrap=True)
    if job.get("error"):
        console.print(f"error: {escape(job['error'])}", soft_wrap=True)
    if job.get("dashboard_url"):
        console.print(f"Ray dashboard: {job['dashboard_url']}", soft_wrap=True)


@app.command()
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


def _watch(client: RingmasterClient, job_id: str, every_s: float = 10.0) -> dict:
    total = client.job(job_id)["spec"]["train"]["steps"]
    if console.is_terminal:
        columns = [
            TextColumn("[bold]{task.fields[state]}"),
            BarColumn(),
            TextColumn("step {task.completed}/{task.total}"),
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


def _shown(state: str | None, new_rows: list[dict]) -> dict[str, Any]:
    """What a progress message changes of the watched fields: state, step (`completed`), loss, val_loss, speed."""
    shown: dict[str, Any] = {"state": state} if state else {}
    for row in new_rows:
        if row.get("loss") is not None:
            shown.update(
                completed=row["step"], loss=_loss_text(row["loss"]), speed=f"{row.get('samples_per_s') or 0:.1f}"
            )
        if row.get("val_loss") is not None:
            shown.update(val_loss=_loss_text(row["val_loss"]))
    return shown


def _watch_in_lines(client: RingmasterClient, job_id: str, total: int, every_s: float) -> None:
    """Without a terminal a progress bar shows nothing until it ends: a plain line instead at each state, at most
    every `every_s` while steps arrive, and at the end."""
    fields: dict[str, Any] = {"state": "…", "completed": 0, "loss": "-", "val_loss": "-", "speed": "-"}
    printed, printed_at = None, float("-inf")

    def line() -> str:
        return (
            f"{fields['state']}  step {fields['completed']}/{total}  loss {fields['loss']}  val {fields['val_loss']}  "
            f"{fields['speed']} samples/s"
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


def _progress(client: RingmasterClient, job_id: str) -> Iterator[tuple[str | None, list[dict]]]:
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


@app.command()
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


@app.command()
@_handled
def cancel(job_id: str, api: ApiOption = None) -> None:
    """Cancel a job; its Ray job is stopped and its resources freed."""
    client = _client(api)
    job = client.cancel(_job_id(client, job_id))
    console.print(f"job {job['id']}: {job['state']}")


@app.command()
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


@app.command()
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
    command = [sys.executable, "-m", "ringmaster.workers.export", chosen["uri"], str(out)]
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


_COUNT_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def _count(text: str) -> int:
    """A parameter count written the way people say it: 7B, 350M, 1.5T, 13e9 or 7000000000."""
    cleaned = text.strip().replace("_", "").replace(",", "")
    scale = _COUNT_SUFFIXES.get(cleaned[-1:].lower(), 1)
    try:
        value = float(cleaned[:-1] if scale > 1 else cleaned) * scale
    except ValueError:
        raise typer.BadParameter(f"not a parameter count: {text!r} (try 7B, 350M or 13e9)") from None
    if value < 1 or value != int(value):
        raise typer.BadParameter(f"a parameter count is a whole number ≥ 1, got {text!r}")
    return int(value)


def _model_options(pairs: list[str]) -> dict[str, Any]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"model options are key=value, got {pair!r}")
        options[key] = yaml.safe_load(value)
    return options


@app.command()
@_handled
def plan(
    gpu_memory_gb: Annotated[float, typer.Option("--gpu-memory-gb", help="Memory of each GPU, GB (10⁹ bytes).")],
    parameters: Annotated[
        str | None, typer.Option("--parameters", "-p", help="Parameter count: 7B, 350M, 13e9.")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="A built-in (tiny-gpt, mlp) sized from its options, instead of --parameters.")
    ] = None,
    option: Annotated[
        list[str] | None, typer.Option("--option", "-o", help="The built-in's option key=value; repeatable.")
    ] = None,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node; tensor parallelism stays inside one.")] = 8,
    nodes: Annotated[int, typer.Option(help="Nodes.")] = 1,
    precision: Annotated[
        str, typer.Option(help="mixed (2+2+4+8, the seeds'), bf16 (ringmaster's autocast, 4+4+8) or fp32.")
    ] = "mixed",
    micro_batch_size: Annotated[
        int | None, typer.Option(help="Sequences per micro-batch: with the shape, activations and TP/PP traffic.")
    ] = None,
    layers: Annotated[int | None, typer.Option(help="Transformer blocks (with --parameters).")] = None,
    hidden: Annotated[int | None, typer.Option(help="Hidden size (with --parameters).")] = None,
    heads: Annotated[int | None, typer.Option(help="Attention heads (with --parameters).")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Sequence length (with --parameters).")] = None,
    microbatches: Annotated[int, typer.Option(help="Pipeline micro-batches per step.")] = 8,
    schedule: Annotated[str, typer.Option(help="gpipe, 1f1b or interleaved1f1b.")] = "1f1b",
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of a table.")] = False,
    api: ApiOption = None,
) -> None:
    """Which parallelism fits a model on a cluster: memory per GPU, traffic per step, bubble, and the pick."""
    request: dict[str, Any] = {
        "parameters": _count(parameters) if parameters is not None else None,
        "model": model,
        "model_options": _model_options(option or []),
        "gpu_memory_gb": gpu_memory_gb,
        "gpus_per_node": gpus_per_node,
        "nodes": nodes,
        "precision": precision,
        "micro_batch_size": micro_batch_size,
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "seq_len": seq_len,
        "microbatches": microbatches,
        "schedule": schedule,
    }
    try:
        result = _client(api).plan(request)
    except ApiError as error:
        _fail(_describe(error, "plan request"))
    if as_json:
        print(json.dumps(result, indent=2))
        return
    _print_plan(result)


def _print_plan(result: dict[str, Any]) -> None:
    console.print(f"[bold]{result['model']}[/bold]: {result['parameters']:,} parameters", soft_wrap=True)
    console.print(f"precision {result['precision']}: {result['precision_note']}", soft_wrap=True)
    console.print(
        f"cluster: {result['nodes']} × {result['gpus_per_node']} = {result['world_size']} GPUs, {result['gpu_memory_gb']:g} GB each"
    )
    table = Table(
        "option",
        "state/GPU",
        "activations",
        "total/GPU",
        "fits",
        "traffic/step",
        "bubble",
        caption="traffic: bytes each GPU sends per step (one micro-batch per replica, m through a pipeline); "
        "? needs the transformer's shape and --micro-batch-size",
    )
    chosen = (result["recommendation"] or {}).get("label")
    for option in result["options"]:
        memory, traffic = option["memory_per_gpu"], option["communication_per_step"]
        fits = {True: "[green]yes[/green]", False: "[red]no[/red]", None: "?"}[option["fits"]]
        state = memory["parameters_gb"] + memory["gradients_gb"] + memory["optimizer_gb"]
        table.add_row(
            f"[bold]{option['label']} ★[/bold]" if option["label"] == chosen else option["label"],
            _gb(state),
            _gb(memory["activations_gb"]),
            _gb(memory["total_gb"]),
            fits,
            _gb(traffic["total_gb"]),
            f"{option['bubble_fraction']} = {option['bubble']:.1%}" if option["bubble"] is not None else "-",
        )
    console.print(table)
    console.print(f"recommended: [bold]{chosen}[/bold]" if chosen else "[red]nothing fits[/red]")
    for reason in result["reasons"] + ((result["recommendation"] or {}).get("reasons") or []):
        console.print(f"  - {reason}", soft_wrap=True)


def _gb(value: float | None) -> str:
    return "?" if value is None else format_bytes(value * GB)


@app.command()
@_handled
def demo(
    spec: Annotated[Path | None, typer.Option(help="Job spec to run.")] = None,
    keep: Annotated[
        bool,
        typer.Option(
            "--keep", help="Leave the server running after the job, so the links printed keep working (Ctrl-C ends it)."
        ),
    ] = False,
) -> None:
    """Start everything locally, train examples/tiny-gpt.yaml over REST, and show it to the end."""
    from ringmaster.api.server import BackgroundServer

    spec_path = spec or _example("tiny-gpt.yaml")
    settings = get_settings()
    console.print("starting the API server, the dispatcher and a local Ray head …")
    with BackgroundServer(settings) as server:
        client = server.client()
        console.print(f"API: {server.url}/docs   Ray dashboard: {server.dashboard_url}", soft_wrap=True)
        job = client.submit_yaml(spec_path.read_text())
        console.print(f"submitted {spec_path.name} as job {job['id']}")
        started = time.monotonic()
        final = _watch(client, job["id"])
        checkpoints = client.checkpoints(job["id"])["items"]
        console.print(f"finished in {time.monotonic() - started:.1f}s")
        if checkpoints:
            console.print(f"checkpoint: {checkpoints[-1]['uri']}", soft_wrap=True)
        console.print(f"Ray dashboard: {final.get('dashboard_url') or server.dashboard_url}", soft_wrap=True)
        if keep:
            console.print(f"the server keeps running at {server.url} (`ringmaster status` finds it); Ctrl-C ends it")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        else:
            console.print(
                "the server and its Ray head stop now, and these links with them; "
                "`ringmaster demo --keep` leaves them running"
            )
    raise typer.Exit(code=0 if final["state"] == "SUCCEEDED" else 1)


def _example(name: str) -> Path:
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (root / "examples" / name).exists():
            return root / "examples" / name
    _fail(f"examples/{name} not found; pass --spec")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Bring the database schema to the newest version."""
    from ringmaster.service.db import upgrade_schema

    url = get_settings().resolved_database_url()
    upgrade_schema(url)
    console.print(f"schema is up to date at {url}")


@contextmanager
def _database_session() -> Iterator[Session]:
    """One transaction on the settings' database, its schema brought up to date first."""
    from ringmaster.service.db import Database, session_scope, upgrade_schema

    url = get_settings().resolved_database_url()
    upgrade_schema(url)
    database = Database.connect(url)
    try:
        with session_scope(database.sessions) as session:
            yield session
    finally:
        database.dispose()


@token_app.command("create")
def token_create(
    tenant: Annotated[
        str, typer.Option("--tenant", help="The tenant the token speaks for; created without quotas when missing.")
    ],
    admin: Annotated[
        bool, typer.Option("--admin", help="See and manage every tenant's jobs, tenants and tokens.")
    ] = False,
    description: Annotated[str | None, typer.Option(help="Who or what holds it.")] = None,
) -> None:
    """Make a token and print it once: only its hash is stored."""
    from ringmaster.service import auth, tenants

    try:
        with _database_session() as session:
            issued = auth.create_token(session, tenant, admin=admin, description=description)
            token_id = issued.row.id
    except (tenants.InvalidTenant, ValueError) as error:
        _fail(str(error))
    if issued.tenant_created:
        console.print(
            f"created tenant {tenant!r} without quotas (set them with `ringmaster tenant quota {tenant}`)",
            soft_wrap=True,
        )
    console.print(
        f"token {token_id} for tenant {tenant!r}{' (admin)' if admin else ''}; it is shown only now:", soft_wrap=True
    )
    print(issued.secret)


@token_app.command("list")
def token_list(tenant: Annotated[str | None, typer.Option(help="Only this tenant's tokens.")] = None) -> None:
    """Every token (never its secret)."""
    from ringmaster.service import auth

    with _database_session() as session:
        rows = [
            (
                str(t.id),
                t.tenant,
                "yes" if t.admin else "",
                t.description or "",
                f"{t.created_at:%Y-%m-%d %H:%M:%S}",
                f"{t.revoked_at:%Y-%m-%d %H:%M:%S}" if t.revoked_at else "",
            )
            for t in auth.list_tokens(session, tenant)
        ]
    table = Table("id", "tenant", "admin", "description", "created", "revoked")
    for row in rows:
        table.add_row(*row)
    console.print(table)


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[int, typer.Argument(help="The token's id, from `ringmaster token list`.")],
) -> None:
    """Refuse the token from the next request on."""
    from ringmaster.service import auth

    try:
        with _database_session() as session:
            auth.revoke_token(session, token_id)
    except auth.TokenNotFound as error:
        _fail(str(error))
    console.print(f"token {token_id} revoked")


def _quota_value(text: str | None, kind: type[int] | type[float], flag: str) -> int | float | None:
    """A quota option: a number >= 0, or 'unlimited'."""
    if text is None or text.strip().lower() in ("unlimited", "none"):
        return None
    try:
        value = kind(text)
    except ValueError:
        raise typer.BadParameter(f"{flag} takes a number >= 0 or 'unlimited', got {text!r}") from None
    if value < 0:
        raise typer.BadParameter(f"{flag} takes a number >= 0 or 'unlimited', got {text!r}")
    return value


GpusOption = Annotated[
    str | None, typer.Option("--gpus", help="GPUs its admitted jobs may hold at once, or 'unlimited'.")
]
CpusOption = Annotated[
    str | None, typer.Option("--cpus", help="CPUs its admitted jobs may hold at once, or 'unlimited'.")
]
JobsOption = Annotated[
    str | None, typer.Option("--jobs", help="Jobs it may have admitted or running at once, or 'unlimited'.")
]


@tenant_app.command("create")
def tenant_create(name: str, gpus: GpusOption = None, cpus: CpusOption = None, jobs: JobsOption = None) -> None:
    """Add a tenant; an omitted quota is unlimited."""
    from ringmaster.service import tenants

    quota = tenants.Quota(
        _quota_value(gpus, int, "--gpus"), _quota_value(cpus, float, "--cpus"), _quota_value(jobs, int, "--jobs")
    )
    try:
        with _database_session() as session:
            if session.get(tenants.Tenant, name) is not None:
                _fail(f"tenant {name!r} exists; change its quotas with `ringmaster tenant quota {name}`")
            tenants.put_tenant(session, name, quota)
    except tenants.InvalidTenant as error:
        _fail(str(error))
    console.print(f"tenant {name!r}: {_quota_text(quota)}")


@tenant_app.command("quota")
def tenant_quota(name: str, gpus: GpusOption = None, cpus: CpusOption = None, jobs: JobsOption = None) -> None:
    """Change the quotas given (a number, or 'unlimited'); the others stay as they are."""
    from ringmaster.service import tenants

    try:
        with _database_session() as session:
            current = tenants.Quota.of(tenants.get_tenant(session, name))
            quota = tenants.Quota(
                current.gpus if gpus is None else _quota_value(gpus, int, "--gpus"),
                current.cpus if cpus is None else _quota_value(cpus, float, "--cpus"),
                current.jobs if jobs is None else _quota_value(jobs, int, "--jobs"),
            )
            tenants.put_tenant(session, name, quota)
    except (tenants.TenantNotFound, tenants.InvalidTenant) as error:
        _fail(str(error))
    console.print(f"tenant {name!r}: {_quota_text(quota)}")


@tenant_app.command("list")
def tenant_list() -> None:
    """Every tenant with its quotas and what its jobs hold now."""
    from ringmaster.service import tenants

    table = Table("tenant", "GPUs", "CPUs", "jobs")
    with _database_session() as session:
        for tenant in tenants.list_tenants(session):
            quota, used = tenants.Quota.of(tenant), tenants.usage(session, tenant.name)
            table.add_row(
                tenant.name, _held(used.gpus, quota.gpus), _held(used.cpus, quota.cpus), _held(used.jobs, quota.jobs)
            )
    console.print(table)


def _held(used: float, limit: float | None) -> str:
    return f"{used:g} / {'unlimited' if limit is None else f'{limit:g}'}"


def _quota_text(quota: Any) -> str:
    return ", ".join(
        f"{resource} {'unlimited' if value is None else f'{value:g}'}"
        for resource, value in (("GPUs", quota.gpus), ("CPUs", quota.cpus), ("jobs", quota.jobs))
    )


def _describe(error: ApiError, subject: str = "job spec") -> str:
    if error.status == 422 and isinstance(error.detail, list):
        lines = []
        for item in error.detail:
            field = ".".join(str(part) for part in item.get("loc", [])[1:]) or "(spec)"
            lines.append(f"  {_naming_field_once(str(item.get('msg')), field)}")
        return f"invalid {subject}:\n" + "\n".join(lines)
    detail = error.detail if isinstance(error.detail, str) else json.dumps(error.detail)
    return f"{detail} (HTTP {error.status})"


def _naming_field_once(message: str, field: str) -> str:
    """`field: message`, naming the field once: a message that begins with its field (as one read without the field
    must: "field: …", or a sentence about it, "field (3) must …") is shown as it is, after the field's whole name."""
    named, separator, rest = message.partition(": ")
    if separator and (field == named or field.endswith("." + named)):
        return f"{field}: {rest}"
    if message.startswith(field + " "):
        return message
    return f"{field}: {message}"


if __name__ == "__main__":
    sys.exit(app())
