"""Submission throughput and latency of the REST API, and queued-to-admitted latency (issue 5's benchmark; not a timed
test).

Starts api.app.create_app on uvicorn in a thread on 127.0.0.1, as `ringmaster serve` runs it, and drives it from a
child process (its own GIL) with concurrent clients, each request carrying a tenant's bearer token. The clients are
asyncio tasks in one event loop, each on its own keep-alive HTTP/1.1 connection that writes the request bytes and reads
the status line, headers and Content-Length body (RawClient): a lean generator, so the server gets the CPU it is
measured on rather than sharing it with an HTTP client library.

1. throughput: N clients POST /v1/jobs back to back for a bounded count and time, with no dispatcher (the API only
   queues): submissions/s and p50/p99/max latency.
2. admission: a second server, with the dispatcher running in it against the stand-in cluster of
   harness/standin_cluster.py, which always has room (its "drivers" report RUNNING then SUCCEEDED through
   service.jobs at once, so finished jobs leave the active set). Jobs are submitted at a fixed rate; each job's
   time from the start of its POST to its admission (jobs.admitted_at, written with the ADMITTED event) gives
   p50/p99/max.

    .venv/bin/python bench/api.py                       # SQLite in a temporary directory
    .venv/bin/python bench/api.py --postgres-url URL    # also PostgreSQL (a fresh schema, dropped afterwards)
RINGMASTER_TEST_POSTGRES_URL is used when --postgres-url is not given.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI
from sqlalchemy import create_engine, select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.ports import free_port
from harness.standin_cluster import StandInCluster
from ringmaster.api.app import create_app
from ringmaster.service import auth
from ringmaster.service.db import session_scope
from ringmaster.service.dispatcher import Dispatcher
from ringmaster.service.logs import configure_logging
from ringmaster.service.models import Job
from ringmaster.service.settings import Settings

T = TypeVar("T")
SPEC: dict[str, object] = {"name": "bench", "model": "mlp", "workers": {"min": 1, "max": 1}, "train": {"steps": 10}}


def _start_dispatcher(settings: Settings) -> Callable[[FastAPI], Callable[[], None]]:
    """The dispatcher thread of `ringmaster serve` (api.server.ControlPlane), on the stand-in cluster."""

    def start(app: FastAPI) -> Callable[[], None]:
        cluster = StandInCluster(drivers=app.state.db.sessions)
        dispatcher = Dispatcher(app.state.db.sessions, cluster, settings)
        app.state.wake_dispatcher = dispatcher.wake
        stop_event = threading.Event()
        thread = threading.Thread(target=dispatcher.run, args=(stop_event,), name="dispatcher", daemon=True)
        thread.start()

        def stop() -> None:
            stop_event.set()
            dispatcher.wake()
            thread.join(timeout=30)
            cluster.close()

        return stop

    return start


class Server:
    def __init__(
        self, database_url: str, data_dir: Path, *, dispatcher: bool, loop: str, http: str, access_log: bool
    ) -> None:
        self.port = free_port()
        settings = Settings(database_url=database_url, data_dir=data_dir, api_port=self.port)
        self.app = app = create_app(settings, start_background=_start_dispatcher(settings) if dispatcher else None)
        self.token = ""
        # With the access log, log_config=None keeps the JSON handler configure_logging installed, as run_server does.
        logging_options = {"log_config": None, "log_level": "info"} if access_log else {"log_level": "warning"}
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, loop=loop, http=http, access_log=access_log, **logging_options
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        with session_scope(self.app.state.db.sessions) as session:  # the schema exists once the server started
            self.token = auth.create_token(session, "bench").secret
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _percentiles(values_s: list[float]) -> dict[str, float]:
    ordered = sorted(values_s)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return {
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "max_ms": ordered[-1] * 1000,
        "mean_ms": statistics.fmean(ordered) * 1000,
    }


WARM_UP = 20


class RawClient:
    """One keep-alive HTTP/1.1 connection that POSTs a fixed JSON body: the load generator costs little CPU, so the
    benchmark measures the server rather than an HTTP client library."""

    def __init__(self, url: str, token: str, body: dict[str, object]) -> None:
        parsed = urlsplit(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        payload = json.dumps(body).encode()
        self.request = (
            f"POST /v1/jobs HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self) -> tuple[int, bytes]:
        """The status code and body of one POST; reconnects when the server closed the connection."""
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        fields: dict[bytes, bytes] = {}
        for line in head.split(b"\r\n")[1:-2]:  # between the status line and the blank line that ends the head
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip()
        if b"content-length" not in fields:
            raise RuntimeError(f"the server answered {status} without a Content-Length, which this client needs")
        body = await self.reader.readexactly(int(fields[b"content-length"]))
        if fields.get(b"connection", b"").lower() == b"close":
            await self.close()
        return status, body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()
        self.reader = self.writer = None


async def _warm_up(url: str, token: str) -> None:
    """A connection, first-request imports, the planner's caches."""
    client = RawClient(url, token, SPEC)
    try:
        for _ in range(WARM_UP):
            status, body = await client.post()
            if status != 201:
                raise RuntimeError(f"warm-up submission answered {status}: {body[:500]!r}")
    finally:
        await client.close()


def _run_loop(main: Callable[[], Awaitable[T]]) -> T:
    """The clients' event loop: uvloop when installed (as the server uses), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def run(url: str, token: str, clients: int, count: int, max_s: float) -> dict[str, float]:
    """Closed loop: each of `clients` connections submits its next job as soon as the last one is answered."""
    latencies: list[float] = []
    errors = 0

    async def client(deadline: float, remaining: list[int]) -> None:
        nonlocal errors
        connection = RawClient(url, token, SPEC)
        try:
            while time.monotonic() < deadline and remaining[0] > 0:
                remaining[0] -= 1  # one event loop: no lock needed between the clients
                started = time.perf_counter()
                status, _ = await connection.post()
                took = time.perf_counter() - started
                if status == 201:
                    latencies.append(took)
                else:
                    errors += 1
        finally:
            await connection.close()

    async def main() -> float:
        await _warm_up(url, token)
        started = time.perf_counter()
        remaining = [count]
        await asyncio.gather(*(client(time.monotonic() + max_s, remaining) for _ in range(clients)))
        return time.perf_counter() - started

    elapsed = _run_loop(main)
    return {
        "submitted": len(latencies),
        "errors": errors,
        "seconds": elapsed,
        "per_s": len(latencies) / elapsed,
        **_percentiles(latencies),
    }


def run_paced(url: str, token: str, clients: int, count: int, rate: float) -> tuple[list[tuple[str, float]], int]:
    """Open loop: job i is posted at start + i/rate (by whichever client is free); returns (job id, POST start)
    pairs."""
    posted: list[tuple[str, float]] = []
    errors = 0
    next_index = [0]

    async def client(start: float) -> None:
        nonlocal errors
        connection = RawClient(url, token, SPEC)
        try:
            while next_index[0] < count:
                index = next_index[0]
                next_index[0] += 1
                await asyncio.sleep(max(0.0, start + index / rate - time.monotonic()))
                wall = time.time()
                status, body = await connection.post()
                if status == 201:
                    posted.append((json.loads(body)["id"], wall))
                else:
                    errors += 1
        finally:
            await connection.close()

    async def main() -> None:
        await _warm_up(url, token)
        start = time.monotonic() + 0.1
        await asyncio.gather(*(client(start) for _ in range(clients)))

    _run_loop(main)
    return posted, errors


def _elsewhere(function: Callable[..., object], *args: object) -> object:
    """The load from a child process: in the server's process the clients would share its GIL and halve its CPU."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


def admission_latency(server: Server, clients: int, count: int, rate: float, wait_s: float = 60.0) -> dict[str, float]:
    """POST start to jobs.admitted_at for count jobs submitted at rate per second."""
    posted, errors = _elsewhere(run_paced, server.url, server.token, clients, count, rate)  # type: ignore[misc]
    started = dict(posted)
    deadline = time.monotonic() + wait_s
    while True:
        with session_scope(server.app.state.db.sessions) as session:
            admitted = dict(
                session.execute(
                    select(Job.id, Job.admitted_at).where(Job.id.in_(started), Job.admitted_at.is_not(None))
                ).all()
            )
        if len(admitted) == len(started) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    waits = [_epoch(at) - started[job_id] for job_id, at in admitted.items()]
    return {"submitted": len(started), "admitted": len(admitted), "errors": errors, **_percentiles(waits)}


def _epoch(moment: datetime) -> float:
    """SQLite hands back naive datetimes; the control plane writes UTC."""
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _report(label: str, result: dict[str, float]) -> None:
    print(
        f"{label:10s} {result['submitted']:6.0f} jobs in {result['seconds']:5.1f}s: {result['per_s']:7.1f}/s  "
        f"p50 {result['p50_ms']:6.1f} ms  p99 {result['p99_ms']:6.1f} ms  max {result['max_ms']:6.1f} ms  "
        f"errors {result['errors']:.0f}  "
        f"server CPU {result['server_cpu_ms']:.2f} ms/job",
        flush=True,
    )


def _report_admission(label: str, rate: float, result: dict[str, float]) -> None:
    print(
        f"{label:10s} {result['admitted']:4.0f}/{result['submitted']:.0f} admitted, submitted at {rate:g}/s: "
        f"POST->ADMITTED p50 {result['p50_ms']:6.1f} ms  p99 {result['p99_ms']:6.1f} ms  "
        f"max {result['max_ms']:6.1f} ms  errors {result['errors']:.0f}",
        flush=True,
    )


@contextmanager
def _postgres_schema(admin_url: str) -> Iterator[str]:
    """A fresh schema on the server (dropped afterwards), as a URL whose search_path is that schema."""
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    with admin.connect() as connection:
        connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    try:
        yield admin.url.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # its first paragraph, refilled by argparse
    parser.add_argument("--clients", type=int, default=8, help="concurrent HTTP clients in the throughput run")
    parser.add_argument(
        "--count", type=int, default=2000, help="submissions per database in the throughput run (0: skip it)"
    )
    parser.add_argument("--max-seconds", type=float, default=30.0, help="stop each throughput run after this long")
    parser.add_argument(
        "--admit-count", type=int, default=300, help="jobs per database in the admission run (0: skip it)"
    )
    parser.add_argument("--admit-rate", type=float, default=10.0, help="submissions per second in the admission run")
    parser.add_argument("--postgres-url", default=os.environ.get("RINGMASTER_TEST_POSTGRES_URL"))
    parser.add_argument("--no-sqlite", action="store_true")
    parser.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"], help="uvicorn's event loop")
    parser.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"], help="uvicorn's HTTP parser")
    parser.add_argument(
        "--access-log", action="store_true", help="log every request as `ringmaster serve` does (to /dev/null)"
    )
    args = parser.parse_args()
    if args.access_log:
        configure_logging(stream=open(os.devnull, "w"))  # noqa: SIM115 — lives as long as the process
    print(
        f"{args.clients} clients, up to {args.count} submissions or {args.max_seconds:.0f}s per database, "
        f"{os.cpu_count()} CPUs, loop={args.loop} http={args.http} access log {'on' if args.access_log else 'off'}",
        flush=True,
    )
    options = {"loop": args.loop, "http": args.http, "access_log": args.access_log}

    def bench(label: str, url_for: Callable[[], AbstractContextManager[str]], data_dir: Path) -> None:
        if args.count:
            with url_for() as url, Server(url, data_dir, dispatcher=False, **options) as server:
                cpu_before = _cpu_seconds()
                result: dict[str, float] = _elsewhere(
                    run, server.url, server.token, args.clients, args.count, args.max_seconds
                )  # type: ignore[assignment]
                # The server's own CPU per job (the clients run in a child): steadier than jobs/s on a shared machine.
                result["server_cpu_ms"] = (_cpu_seconds() - cpu_before) * 1000 / (result["submitted"] + WARM_UP)
                _report(label, result)
        if args.admit_count:
            with url_for() as url, Server(url, data_dir, dispatcher=True, **options) as server:
                _report_admission(
                    label, args.admit_rate, admission_latency(server, 4, args.admit_count, args.admit_rate)
                )

    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_sqlite:

            @contextmanager
            def sqlite_url() -> Iterator[str]:
                yield f"sqlite:///{tmp}/bench-{uuid.uuid4().hex[:8]}.db"

            bench("sqlite", sqlite_url, Path(tmp))
        if args.postgres_url:
            bench("postgres", lambda: _postgres_schema(args.postgres_url), Path(tmp))


if __name__ == "__main__":
    main()
