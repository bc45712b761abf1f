"""The commands that run ringmaster in this process: `serve` (the API server, the dispatcher and an embedded Ray head)
and `demo` (all of that in the background, one example job trained over REST). They alone import the API's server,
and only when they run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from ringmaster.cli.failures import _fail, _handled
from ringmaster.cli.jobs import _watch
from ringmaster.cli.render import console
from ringmaster.service.embedded_ray import HeadStartFailed
from ringmaster.service.settings import get_settings


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
