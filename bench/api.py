"""Submission throughput and latency of the REST API (issue 5's benchmark; not a timed test).

Starts api.app.create_app on uvicorn in a thread on 127.0.0.1 (no Ray: the API only queues jobs), then N
concurrent httpx clients POST /v1/jobs, each with a tenant's bearer token, for a bounded count and time.
Reports submissions/s and p50/p99/max.

    .venv/bin/python bench/api.py                       # SQLite in a temporary directory
    .venv/bin/python bench/api.py --postgres-url URL    # also PostgreSQL (a fresh schema, dropped afterwards)
RINGMASTER_TEST_POSTGRES_URL is used when --postgres-url is not given.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import uvicorn
from sqlalchemy import create_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.app import create_app  # noqa: E402
from service import auth  # noqa: E402
from service.db import session_scope  # noqa: E402
from service.settings import Settings  # noqa: E402

SPEC = {"name": "bench", "model": "mlp", "workers": {"min": 1, "max": 1}, "train": {"steps": 10}}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    def __init__(self, database_url: str, data_dir: Path) -> None:
        self.port = _free_port()
        self.app = app = create_app(Settings(database_url=database_url, data_dir=data_dir))
        self.token = ""
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "Server":
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


def run(url: str, token: str, clients: int, count: int, max_s: float) -> dict[str, float]:
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()
    remaining = [count]
    deadline = time.monotonic() + max_s

    def worker() -> None:
        nonlocal errors
        with httpx.Client(base_url=url, headers=headers, timeout=30.0) as http:
            while time.monotonic() < deadline:
                with lock:
                    if remaining[0] <= 0:
                        return
                    remaining[0] -= 1
                started = time.perf_counter()
                response = http.post("/v1/jobs", json=SPEC)
                took = time.perf_counter() - started
                with lock:
                    if response.status_code == 201:
                        latencies.append(took)
                    else:
                        errors += 1

    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers) as http:  # warm-up: connections, first-request imports, the planner's caches
        for _ in range(20):
            http.post("/v1/jobs", json=SPEC).raise_for_status()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000

    return {"submitted": len(latencies), "errors": errors, "seconds": elapsed, "per_s": len(latencies) / elapsed,
            "p50_ms": pct(0.50), "p99_ms": pct(0.99), "max_ms": latencies[-1] * 1000, "mean_ms": statistics.fmean(latencies) * 1000}


def run_elsewhere(server: Server, clients: int, count: int, max_s: float) -> dict[str, float]:
    """The load from a child process: in the server's process the clients would share its GIL and halve its CPU."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(run, server.url, server.token, clients, count, max_s).result()


def _report(label: str, result: dict[str, float]) -> None:
    print(f"{label:10s} {result['submitted']:6.0f} jobs in {result['seconds']:5.1f}s: {result['per_s']:7.1f}/s  "
          f"p50 {result['p50_ms']:6.1f} ms  p99 {result['p99_ms']:6.1f} ms  max {result['max_ms']:6.1f} ms  errors {result['errors']:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="concurrent HTTP clients")
    parser.add_argument("--count", type=int, default=2000, help="submissions per database")
    parser.add_argument("--max-seconds", type=float, default=30.0, help="stop each run after this long")
    parser.add_argument("--postgres-url", default=os.environ.get("RINGMASTER_TEST_POSTGRES_URL"))
    parser.add_argument("--no-sqlite", action="store_true")
    args = parser.parse_args()
    print(f"{args.clients} clients, up to {args.count} submissions or {args.max_seconds:.0f}s per database, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_sqlite:
            with Server(f"sqlite:///{tmp}/bench.db", Path(tmp)) as server:
                _report("sqlite", run_elsewhere(server, args.clients, args.count, args.max_seconds))
        if args.postgres_url:
            admin = create_engine(args.postgres_url, isolation_level="AUTOCOMMIT")
            schema = f"bench_{uuid.uuid4().hex[:12]}"
            with admin.connect() as connection:
                connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
            try:
                url = admin.url.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)
                with Server(url, Path(tmp)) as server:
                    _report("postgres", run_elsewhere(server, args.clients, args.count, args.max_seconds))
            finally:
                with admin.connect() as connection:
                    connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
                admin.dispose()


if __name__ == "__main__":
    main()
