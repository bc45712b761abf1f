"""The control plane at scale (issue 48): the API's latencies and the dispatcher's pass with 100,000 jobs in the
database and a stand-in cluster of 1,000 nodes, on SQLite and PostgreSQL (a benchmark, not a timed test).

    python bench/control_plane_scale.py [--jobs 100000] [--queued 10000] [--nodes 1000] [--requests 100]
                                        [--postgres-url URL] [--no-sqlite]
RINGMASTER_TEST_POSTGRES_URL is used when --postgres-url is not given (a fresh schema, dropped afterwards).

The database: bench/dispatch_pass.py's full cluster (bench/scheduling.py's 1,000 8-GPU nodes about 97 % held by
running jobs, --queued jobs waiting, four tenants of unequal weights) written by its write_database, the rest of
--jobs finished (succeeded, failed, cancelled) over the past two months, every job's spec as submit stores it (a full
JobSpec, defaults filled in), each finished job's events and attempt, and a week of the dispatcher's fair-share
samples, all inserted in bulk. Then, each against its goal:

- pass: bench/dispatch_pass.py's one_pass (the dispatcher's reads, input, plan, autoscaler request and queue record)
  beside the pure plan's CPU time on the same input, a steady pass's median: goal pass <= 2x plan;
- the API, served by api.app.create_app on uvicorn (no dispatcher: the API alone, as bench/api.py's throughput run)
  and driven from a child process by one keep-alive client, request after request (bench/api.py's raw HTTP client):
  POST /v1/jobs (goal p99 < 50 ms), GET /v1/jobs first pages with and without the state filter, with an admin's token
  and a tenant's, and a deep page by offset (the API pages by offset), GET /v1/queue likewise (goal p99 < 100 ms for
  each listing), and the web view's jobs page: its HTML, its scripts and styles and the two API calls it makes to
  show the first page (/v1/me, /v1/jobs?limit=200), one after the other, as one load.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import bindparam, insert, update

from bench.api import RawClient, Server, _elsewhere, _postgres_schema, _run_loop
from bench.dispatch_pass import EPOCH, DispatcherMemory, one_pass, write_database
from bench.scheduling import full_cluster
from ringmaster.service import auth
from ringmaster.service.db import Database, session_scope, upgrade_schema
from ringmaster.service.models import Attempt, Job, JobEvent, TenantShare
from ringmaster.service.naming import submission_id_for
from ringmaster.service.scheduling.model import PolicyName, PolicySettings, QueuedJob, RunningJob, SchedulingInput
from ringmaster.service.spec import JobSpec

SUBMIT_GOAL_MS = 50.0
LIST_GOAL_MS = 100.0
PASS_GOAL_RATIO = 2.0
BATCH = 5000
SHARE_EVERY_S = 10  # the dispatcher samples the tenants' standing every 10 s, kept for a week
FINISHED_STATES = (("SUCCEEDED", 0.80), ("FAILED", 0.12), ("CANCELLED", 0.08))
TENANT_SHARES = (0.4, 0.3, 0.2, 0.1)  # of the finished jobs, team-0 to team-3

# What a team submits: a full spec (the stored form has every default filled in, ~1.1 kB of JSON).
SUBMITTED: dict[str, Any] = {
    "name": "scale",
    "model": "tiny-gpt",
    "workers": {"min": 1, "max": 1, "gpus_per_worker": 1, "cpus_per_worker": 4},
    "train": {
        "steps": 5000,
        "global_batch_size": 256,
        "micro_batch_size": 8,
        "lr": 3e-4,
        "warmup_steps": 100,
        "precision": "bf16",
        "eval_every_steps": 500,
    },
    "checkpoint": {"every_steps": 500, "keep": 3},
    "runtime_env": {"env_vars": {"WANDB_MODE": "offline"}},
}
STORED = JobSpec.model_validate(SUBMITTED).model_dump(mode="json")
ASSETS = (
    "/ui/static/vendor/uplot-1.6.31/uPlot.min.css",
    "/ui/static/app.css",
    "/ui/static/vendor/uplot-1.6.31/uPlot.iife.min.js",
    "/ui/static/app.js",
)


def _stored_spec(name: str, workers: dict[str, Any], priority: int, preemptible: bool) -> dict[str, Any]:
    """STORED with this job's name, size and priority (the shape the dispatcher reads stays the row's own)."""
    return STORED | {
        "name": name,
        "workers": STORED["workers"] | workers,
        "priority": priority,
        "preemptible": preemptible,
    }


def build_database(database: Database, jobs: int, queued: int, nodes: int, seed: int) -> tuple[Any, SchedulingInput]:
    """The full cluster's rows (write_database), full specs for them, then finished jobs up to `jobs`, their events
    and attempts, and a week of share samples; returns (the cluster view, the scheduling state)."""
    state = full_cluster(queued, nodes, PolicyName.ELASTIC, seed)
    view = write_database(database, state)
    rng = random.Random(seed)
    with database.engine.begin() as connection:
        # write_database's specs hold only what the plan reads; a listing serializes the whole stored spec.
        live: list[tuple[QueuedJob | RunningJob, str]] = [
            (job, f"queued-{index}") for index, job in enumerate(state.queued)
        ]
        live += [(job, f"running-{index}") for index, job in enumerate(state.running)]
        respec = [
            {
                "job_id": job.id,
                "new_spec": _stored_spec(
                    name,
                    {
                        "min": job.min_workers,
                        "max": job.max_workers,
                        "gpus_per_worker": job.shape.gpus,
                        "cpus_per_worker": job.shape.cpus,
                    },
                    job.priority,
                    job.preemptible,
                ),
                "new_name": name,
            }
            for job, name in live
        ]
        statement = (
            update(Job)
            .where(Job.id == bindparam("job_id"))
            .values(spec=bindparam("new_spec"), name=bindparam("new_name"))
        )
        for start in range(0, len(respec), BATCH):
            connection.execute(statement, respec[start : start + BATCH])
        finished = max(0, jobs - len(state.queued) - len(state.running))
        tenants = [tenant.name for tenant in state.tenants]
        span_s = 60 * 86_400  # two months of finished work, before the queue's oldest job
        for start in range(0, finished, BATCH):
            rows, events, attempts = [], [], []
            for index in range(start, min(finished, start + BATCH)):
                job_id = uuid.UUID(int=rng.getrandbits(128)).hex
                created = EPOCH - timedelta(seconds=span_s * (1 - index / max(1, finished)))
                ran_s = rng.uniform(60, 6 * 3600)
                admitted = created + timedelta(seconds=rng.uniform(1, 600))
                ended = admitted + timedelta(seconds=ran_s)
                final = rng.choices([s for s, _ in FINISHED_STATES], [w for _, w in FINISHED_STATES])[0]
                tenant = rng.choices(tenants, TENANT_SHARES)[0]
                gpus = rng.choice((1, 1, 2, 4, 8))
                priority = rng.randint(0, 3)
                name = f"train-{index % 500}"
                error = "Traceback (most recent call last): ... RuntimeError: CUDA out of memory" * 3
                rows.append(
                    {
                        "id": job_id,
                        "name": name,
                        "spec": _stored_spec(name, {"min": gpus, "max": gpus}, priority, True),
                        "state": final,
                        "priority": priority,
                        "attempt": 1,
                        "failures": 1 if final == "FAILED" else 0,
                        "preemptions": 0,
                        "created_at": created,
                        "admitted_at": admitted,
                        "started_at": admitted + timedelta(seconds=20),
                        "finished_at": ended,
                        "error": error if final == "FAILED" else None,
                        "submission_id": submission_id_for(job_id, 1),
                        "cancel_requested": final == "CANCELLED",
                        "tenant": tenant,
                    }
                )
                steps = [(None, "QUEUED", created, "submitted"), ("QUEUED", "ADMITTED", admitted, "admitted")]
                steps += [("ADMITTED", "RUNNING", admitted + timedelta(seconds=20), "driver running")]
                steps += [("RUNNING", final, ended, final.lower())]
                events += [
                    {
                        "job_id": job_id,
                        "at": at,
                        "from_state": before,
                        "to_state": after,
                        "kind": "transition",
                        "message": message,
                        "data": None,
                    }
                    for before, after, at, message in steps
                ]
                attempts.append(
                    {
                        "job_id": job_id,
                        "number": 1,
                        "submission_id": submission_id_for(job_id, 1),
                        "placement_group": submission_id_for(job_id, 1),
                        "world_size": gpus,
                        "started_at": admitted,
                        "ended_at": ended,
                        "outcome": final,
                        "max_workers": gpus,
                        "last_report_seq": 40,
                    }
                )
            connection.execute(insert(Job), rows)
            connection.execute(insert(JobEvent), events)
            connection.execute(insert(Attempt), attempts)
        samples_end = EPOCH + timedelta(seconds=state.now)
        count = 7 * 86_400 // SHARE_EVERY_S
        shares = [
            {
                "at": samples_end - timedelta(seconds=SHARE_EVERY_S * step),
                "tenant": tenant,
                "held_gpus": 1000,
                "held_cpus": 4000.0,
                "share": 0.25,
                "decayed_share": 0.25,
                "entitled_share": 0.25,
            }
            for step in range(count)
            for tenant in tenants
        ]
        for start in range(0, len(shares), BATCH * 4):
            connection.execute(insert(TenantShare), shares[start : start + BATCH * 4])
    return view, state


def dispatcher_pass(database: Database, view: Any, state: SchedulingInput, passes: int) -> dict[str, float]:
    """bench/dispatch_pass.py's passes on this database: the first (places every job), then the steady ones, each with
    the pure plan on its input beside it."""
    policy = PolicySettings(name=PolicyName.ELASTIC, min_run_s=300.0)
    memory = DispatcherMemory()
    first = one_pass(database, memory, view, policy, state.now)
    steady = [one_pass(database, memory, view, policy, state.now) for _ in range(passes)]
    return {
        "first_ms": first["pass"] * 1000,
        **{
            f"{phase}_ms": statistics.median(t[phase] for t in steady) * 1000
            for phase in ("pass", "pass_cpu", "pure", "read", "input", "record")
        },
    }


@dataclass(frozen=True)
class Probe:
    """A named sequence of requests timed as one (a web page's load is several)."""

    name: str
    paths: tuple[str, ...]
    token: str
    goal_ms: float | None = None  # None: shown, no goal of its own


class RawGet(RawClient):
    """bench/api.py's raw keep-alive client, for a GET of a given path."""

    def __init__(self, url: str, token: str, path: str) -> None:
        super().__init__(url, token, {})
        self.request = (
            f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nAuthorization: Bearer {token}\r\n\r\n"
        ).encode()


def time_probes(url: str, probes: list[Probe], count: int) -> dict[str, list[float]]:
    """Each probe `count` times (after 3 untimed), one request after another on one connection per path: its
    seconds each time."""

    async def main() -> dict[str, list[float]]:
        timings: dict[str, list[float]] = {}
        for probe in probes:
            clients = [RawGet(url, probe.token, path) for path in probe.paths]
            seconds = []
            for round_ in range(count + 3):
                began = time.perf_counter()
                for path, client in zip(probe.paths, clients, strict=True):
                    status, body = await client.post()
                    if status != 200:
                        raise RuntimeError(f"GET {path} answered {status}: {body[:300]!r}")
                if round_ >= 3:
                    seconds.append(time.perf_counter() - began)
            for client in clients:
                await client.close()
            timings[probe.name] = seconds
        return timings

    return _run_loop(main)


def time_submits(url: str, token: str, count: int) -> list[float]:
    """POST /v1/jobs `count` times (after 3 untimed), one after another on one connection: the seconds of each."""

    async def main() -> list[float]:
        client = RawClient(url, token, SUBMITTED)
        seconds = []
        for index in range(count + 3):
            began = time.perf_counter()
            status, body = await client.post()
            if status != 201:
                raise RuntimeError(f"POST /v1/jobs answered {status}: {body[:300]!r}")
            if index >= 3:
                seconds.append(time.perf_counter() - began)
        await client.close()
        return seconds

    return _run_loop(main)


def p99_ms(seconds: list[float]) -> float:
    ordered = sorted(seconds)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000


def _line(name: str, seconds: list[float], goal_ms: float | None) -> str:
    p99 = p99_ms(seconds)
    verdict = "" if goal_ms is None else f"  goal < {goal_ms:g} ms: {'holds' if p99 < goal_ms else 'DOES NOT HOLD'}"
    return f"  {name:44s} p50 {statistics.median(seconds) * 1000:7.1f} ms  p99 {p99:7.1f} ms{verdict}"


def probes_for(admin: str, tenant: str, deep_all: int, deep_tenant: int, deep_queue: int) -> list[Probe]:
    goal = LIST_GOAL_MS
    return [
        Probe("GET /v1/jobs (admin, first page)", ("/v1/jobs",), admin, goal),
        Probe("GET /v1/jobs?state=SUCCEEDED (admin)", ("/v1/jobs?state=SUCCEEDED",), admin, goal),
        Probe("GET /v1/jobs?state=QUEUED (admin)", ("/v1/jobs?state=QUEUED",), admin, goal),
        Probe(f"GET /v1/jobs?offset={deep_all} (admin, deep)", (f"/v1/jobs?offset={deep_all}",), admin, goal),
        Probe("GET /v1/jobs (tenant, first page)", ("/v1/jobs",), tenant, goal),
        Probe("GET /v1/jobs?state=QUEUED (tenant)", ("/v1/jobs?state=QUEUED",), tenant, goal),
        Probe("GET /v1/jobs?state=FAILED (tenant)", ("/v1/jobs?state=FAILED",), tenant, goal),
        Probe(f"GET /v1/jobs?offset={deep_tenant} (tenant, deep)", (f"/v1/jobs?offset={deep_tenant}",), tenant, goal),
        Probe("GET /v1/jobs?limit=500 (admin)", ("/v1/jobs?limit=500",), admin, None),
        Probe("GET /v1/queue (admin, first page)", ("/v1/queue",), admin, goal),
        Probe("GET /v1/queue (tenant, first page)", ("/v1/queue",), tenant, goal),
        Probe(f"GET /v1/queue?offset={deep_queue} (admin, deep)", (f"/v1/queue?offset={deep_queue}",), admin, goal),
        Probe("GET /v1/queue?limit=500 (web's queue page)", ("/v1/queue?limit=500",), admin, None),
        Probe("web jobs page: HTML, assets, /v1/me, /v1/jobs", ("/ui", *ASSETS, "/v1/me", "/v1/jobs?limit=200"), admin),
        Probe("web jobs page: its API calls alone", ("/v1/me", "/v1/jobs?limit=200"), admin),
    ]


def bench(label: str, url_for: Callable[[], AbstractContextManager[str]], args: argparse.Namespace) -> None:
    with url_for() as url, tempfile.TemporaryDirectory() as data_dir:
        upgrade_schema(url)
        database = Database.connect(url)
        began = time.perf_counter()
        view, state = build_database(database, args.jobs, args.queued, args.nodes, args.seed)
        if database.engine.dialect.name == "postgresql":  # what autovacuum does to a settled database
            with database.engine.connect() as connection:
                connection.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM ANALYZE")
        built_s = time.perf_counter() - began
        print(
            f"{label}: {args.jobs} jobs ({len(state.queued)} queued, {len(state.running)} running), "
            f"{args.nodes} nodes, built in {built_s:.0f} s",
            flush=True,
        )
        timed = dispatcher_pass(database, view, state, args.passes)
        ratio = timed["pass_ms"] / timed["pure_ms"]
        print(
            f"  dispatcher pass (steady, median of {args.passes}) {timed['pass_ms']:7.0f} ms: read "
            f"{timed['read_ms']:.0f}, input {timed['input_ms']:.0f}, autoscaler request and record "
            f"{timed['record_ms']:.0f}; first pass {timed['first_ms']:.0f} ms\n  the pure plan on the same input "
            f"{timed['pure_ms']:.0f} ms CPU: pass / plan = {ratio:.2f}  goal <= {PASS_GOAL_RATIO:g}: "
            f"{'holds' if ratio <= PASS_GOAL_RATIO else 'DOES NOT HOLD'}  (the pass's CPU in this process "
            f"{timed['pass_cpu_ms']:.0f} ms, {timed['pass_cpu_ms'] / timed['pure_ms']:.2f}x the plan: steadier on a "
            "loaded machine; on PostgreSQL the server's CPU is not in it)",
            flush=True,
        )
        database.dispose()
        with Server(url, Path(data_dir), dispatcher=False, loop="auto", http="auto", access_log=False) as server:
            tenant = state.tenants[1].name
            with session_scope(server.app.state.db.sessions) as session:
                admin = auth.create_token(session, state.tenants[0].name, admin=True).secret
                member = auth.create_token(session, tenant).secret
                tenant_jobs = session.query(Job).filter(Job.tenant == tenant).count()
            probes = probes_for(admin, member, args.jobs - 100, tenant_jobs - 100, max(0, args.queued - 100))
            timings: dict[str, list[float]] = _elsewhere(time_probes, server.url, probes, args.requests)  # type: ignore[assignment]
            for probe in probes:
                print(_line(probe.name, timings[probe.name], probe.goal_ms), flush=True)
            submits: list[float] = _elsewhere(time_submits, server.url, member, args.requests)  # type: ignore[assignment]
            print(_line("POST /v1/jobs", submits, SUBMIT_GOAL_MS), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000, help="jobs in the database, finished and queued")
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1_000)
    parser.add_argument("--passes", type=int, default=5, help="steady dispatcher passes timed")
    parser.add_argument("--requests", type=int, default=100, help="timed requests of each kind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--postgres-url", default=os.environ.get("RINGMASTER_TEST_POSTGRES_URL"))
    parser.add_argument("--no-sqlite", action="store_true")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; p50/p99 of {args.requests} requests each, one client, one request at a time")

    if not args.no_sqlite:
        with tempfile.TemporaryDirectory() as folder:

            @contextmanager
            def sqlite_url() -> Iterator[str]:
                yield f"sqlite:///{folder}/scale.db"

            bench("sqlite", sqlite_url, args)
    if args.postgres_url:
        bench("postgres", lambda: _postgres_schema(args.postgres_url), args)


if __name__ == "__main__":
    main()
