"""The `ringmaster` command line: serve, submit, status, watch, logs, cancel, demo, db upgrade."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from service.client import ApiError, RingmasterClient
from service.settings import get_settings

app = typer.Typer(help="ringmaster: elastic distributed training as a service.", no_args_is_help=True)
db_app = typer.Typer(help="Database administration.", no_args_is_help=True)
app.add_typer(db_app, name="db")
console = Console()

ApiOption = Annotated[Optional[str], typer.Option("--api", help="API URL; default from RINGMASTER_API_URL / host and port.")]
_STATE_STYLE = {"SUCCEEDED": "green", "FAILED": "red", "CANCELLED": "yellow", "RUNNING": "cyan", "ADMITTED": "blue", "QUEUED": "white"}


def _client(api: str | None) -> RingmasterClient:
    return RingmasterClient(api or get_settings().resolved_api_url())


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(code=1)


@app.command()
def serve(port: Annotated[Optional[int], typer.Option(help="API port (RINGMASTER_API_PORT).")] = None,
          host: Annotated[Optional[str], typer.Option(help="API host (RINGMASTER_API_HOST).")] = None) -> None:
    """Run the API server and the dispatcher (and an embedded Ray head unless RINGMASTER_RAY_ADDRESS is set)."""
    from api.server import run_server  # the composition root lives with the API, which may import the service

    overrides = {key: value for key, value in {"api_port": port, "api_host": host}.items() if value is not None}
    run_server(get_settings().model_copy(update=overrides))


@app.command()
def submit(file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Job spec, YAML or JSON.")],
           api: ApiOption = None) -> None:
    """Submit a job spec; prints the new job's id."""
    try:
        job = _client(api).submit_yaml(file.read_text())
    except ApiError as error:
        _fail(_describe(error))
    console.print(f"submitted [bold]{job['name']}[/bold] as job [bold]{job['id']}[/bold] ({job['state']})")
    print(job["id"])


@app.command()
def status(job_id: Annotated[Optional[str], typer.Argument()] = None, api: ApiOption = None,
           state: Annotated[Optional[str], typer.Option(help="Only jobs in this state.")] = None) -> None:
    """A table of jobs, or one job's details."""
    client = _client(api)
    try:
        rows = [client.job(job_id)] if job_id else client.jobs(state=state)["items"]
    except ApiError as error:
        _fail(_describe(error))
    table = Table("id", "name", "state", "attempt", "created", "finished", "error")
    for job in rows:
        style = _STATE_STYLE.get(job["state"], "white")
        table.add_row(job["id"], job["name"], f"[{style}]{job['state']}[/{style}]", str(job["attempt"]),
                      job["created_at"][:19], (job.get("finished_at") or "")[:19], (job.get("error") or "")[:60])
    console.print(table)
    if job_id and rows[0].get("dashboard_url"):
        console.print(f"Ray dashboard: {rows[0]['dashboard_url']}")


@app.command()
def watch(job_id: str, api: ApiOption = None) -> None:
    """Live progress (step, loss, samples/s) until the job ends."""
    job = _watch(_client(api), job_id)
    raise typer.Exit(code=0 if job["state"] == "SUCCEEDED" else 1)


def _watch(client: RingmasterClient, job_id: str) -> dict:
    total = client.job(job_id)["spec"]["train"]["steps"]
    columns = [TextColumn("[bold]{task.fields[state]}"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]} samples/s"), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=total, state="…", loss="-", speed="-")
        for job, new_rows in client.follow(job_id):
            update = {"state": job["state"]}
            for row in new_rows:
                if row.get("loss") is not None:
                    update.update(completed=row["step"], loss=f"{row['loss']:.4f}", speed=f"{row.get('samples_per_s') or 0:.1f}")
            progress.update(task, **update)
    style = _STATE_STYLE.get(job["state"], "white")
    console.print(f"job {job_id}: [{style}]{job['state']}[/{style}]")
    if job.get("error"):
        console.print(job["error"])
    return job


@app.command()
def logs(job_id: str, api: ApiOption = None) -> None:
    """The job driver's log from Ray."""
    try:
        print(_client(api).logs(job_id))
    except ApiError as error:
        _fail(_describe(error))


@app.command()
def cancel(job_id: str, api: ApiOption = None) -> None:
    """Cancel a job; its Ray job is stopped and its resources freed."""
    try:
        job = _client(api).cancel(job_id)
    except ApiError as error:
        _fail(_describe(error))
    console.print(f"job {job_id}: {job['state']}")


@app.command()
def demo(spec: Annotated[Optional[Path], typer.Option(help="Job spec to run.")] = None) -> None:
    """Start everything locally, train examples/tiny-gpt.yaml over REST, and show it to the end."""
    from api.server import BackgroundServer

    spec_path = spec or _example("tiny-gpt.yaml")
    settings = get_settings()
    console.print("starting the API server, the dispatcher and a local Ray head …")
    with BackgroundServer(settings) as server:
        client = RingmasterClient(server.url)
        console.print(f"API: {server.url}/docs   Ray dashboard: {server.dashboard_url}")
        job = client.submit_yaml(spec_path.read_text())
        console.print(f"submitted {spec_path.name} as job {job['id']}")
        started = time.monotonic()
        final = _watch(client, job["id"])
        checkpoints = client.checkpoints(job["id"])["items"]
        console.print(f"finished in {time.monotonic() - started:.1f}s")
        if checkpoints:
            console.print(f"checkpoint: {checkpoints[-1]['uri']}", soft_wrap=True)
        console.print(f"Ray dashboard: {final.get('dashboard_url') or server.dashboard_url}", soft_wrap=True)
    raise typer.Exit(code=0 if final["state"] == "SUCCEEDED" else 1)


def _example(name: str) -> Path:
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (root / "examples" / name).exists():
            return root / "examples" / name
    _fail(f"examples/{name} not found; pass --spec")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Bring the database schema to the newest version."""
    from service.db import upgrade_schema

    url = get_settings().resolved_database_url()
    upgrade_schema(url)
    console.print(f"schema is up to date at {url}")


def _describe(error: ApiError) -> str:
    if error.status == 422 and isinstance(error.detail, list):
        return "invalid job spec:\n" + "\n".join(
            f"  {'.'.join(str(part) for part in item.get('loc', [])[1:]) or '(spec)'}: {item.get('msg')}" for item in error.detail)
    return str(error)


if __name__ == "__main__":
    sys.exit(app())
