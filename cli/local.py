"""The commands that run ringmaster on this machine: `serve` (the API server, the dispatcher and an embedded Ray head),
`stop` (ends the server a data directory names) and `demo` (all of that in the background, one example job trained
over REST). `serve` and `demo` alone import the API's server, and only when they run."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Annotated

import typer

from ringmaster.cli.failures import _fail, _handled
from ringmaster.cli.jobs import _watch
from ringmaster.cli.render import console
from ringmaster.service.embedded_ray import HeadStartFailed, recorded_head, stop_head
from ringmaster.service.server_lock import DataDirInUse, ServerLock, running_server
from ringmaster.service.settings import get_settings

# How much longer than its grace period `stop` waits for a server to end before it kills it: the server's own stop
# is bounded by the grace period, so this is only reached by a server that hangs.
_STOP_MARGIN_S = 10.0


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
    except (HeadStartFailed, DataDirInUse) as error:
        _fail(str(error))


def stop() -> None:
    """Stop the local server of RINGMASTER_DATA_DIR and everything it started, as SIGTERM does, and wait for it."""
    settings = get_settings()
    data_dir = settings.data_dir.resolve()
    pid = running_server(settings.server_pid_path())
    if pid is None:
        head = recorded_head(settings.data_dir)
        if head is not None and head.running():  # its server was killed without a chance to stop it
            stop_head(head, settings.data_dir)
            console.print(
                f"no ringmaster server was running on {data_dir}; ended the Ray head (pid {head.pid}) it left",
                soft_wrap=True,
            )
            return
        _fail(f"no ringmaster server is running on {data_dir} (RINGMASTER_DATA_DIR)")
    started = time.monotonic()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # it ended in between
    except PermissionError:
        _fail(f"the ringmaster server on {data_dir} (pid {pid}) is another user's: it may not be stopped by you")
    deadline = started + settings.stop_grace_s + _STOP_MARGIN_S
    while running_server(settings.server_pid_path()) == pid:
        if time.monotonic() > deadline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            head = recorded_head(settings.data_dir)
            if head is not None:
                stop_head(head, settings.data_dir, grace_s=0)
            _fail(f"the server (pid {pid}) did not stop within {deadline - started:.0f} s: killed it and its Ray head")
        time.sleep(0.1)
    console.print(
        f"stopped the ringmaster server on {data_dir} (pid {pid}) in {time.monotonic() - started:.1f} s", soft_wrap=True
    )


@_handled
def demo(
    spec: Annotated[Path | None, typer.Option(help="Job spec to run.")] = None,
    keep: Annotated[
        bool,
        typer.Option(
            "--keep",
            help="Leave the server running after the job, so the links printed keep working (Ctrl-C or "
            "`ringmaster stop` ends it).",
        ),
    ] = False,
) -> None:
    """Start everything locally, train examples/tiny-gpt.yaml over REST, and show it to the end."""
    from ringmaster.api.server import BackgroundServer

    spec_path = spec or _example("tiny-gpt.yaml")
    settings = get_settings()
    try:
        lock = ServerLock(settings.server_pid_path())  # as `serve`'s: one server a data directory, found by `stop`
    except DataDirInUse as error:
        _fail(str(error))
    # `ringmaster stop`, docker and systemd send SIGTERM: it ends the demo as Ctrl-C does, the server and head with it.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    console.print("starting the API server, the dispatcher and a local Ray head …")
    with lock, BackgroundServer(settings) as server:
        client = server.client()
        console.print(
            f"API: {server.url}/docs   Ray dashboard: {server.dashboard_url}{server.plane.settings.ray_token_hint()}",
            soft_wrap=True,
        )
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
            console.print(
                f"the server keeps running at {server.url} (`ringmaster status` finds it); Ctrl-C or "
                "`ringmaster stop` ends it",
                soft_wrap=True,
            )
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
