"""The simulator's job model against a live run (issue 48): one small trace through the live service on a simulated
Ray cluster, and through `ringmaster simulate`'s engine on a cluster of the same shape, each job's completion time
(JCT) compared.

    python bench/simulator_vs_live.py [--trace examples/traces/live_check.csv] [--nodes 2] [--gpus-per-node 2]
                                      [--policy elastic] [--calibration-sizes 2 1 2] [--json OUT.json]

Live: a ray.cluster_utils cluster of `--nodes` nodes with `--gpus-per-node` logical GPUs each (Ray counts them; no
device is touched), the control plane on it (the dispatcher planning every dispatch_interval_s with `--policy`), and
each trace job submitted over REST at its submit time as a script-mode job of `gpus` one-GPU workers (`min_gpus`
its workers.min) whose command sleeps `duration × gpus / WORLD_SIZE` seconds: work that takes the trace's duration
at the requested size and scales linearly with the size it got, as the simulator's linear job model assumes, and
that the machine's CPU load does not stretch. Each job's submit, admission, first RUNNING and end are read from its
events (GET /v1/jobs/{id}/events).

Start overhead: before the trace, `--calibration-sizes` jobs run one at a time on the idle cluster, each sleeping
CALIBRATION_SLEEP_S; a job's overhead is its JCT less that sleep (admission, the Ray job's driver, the worker actors,
the script's interpreter, the end reported). The first is cold (Ray's first job driver) and left out; the mean of the
rest is the overhead. A trace's duration counts start-up (docs/operations/simulate.md), and the job model has no
setting for a first start, so the simulated trace is the live one (the submit times the live run actually had) with
each duration lengthened by that overhead; restart_s (a start after a preemption) is set to it too.

Simulated: the same trace on a ClusterShape of the same nodes and GPUs, the same policy, scheduling_interval_s = the
live dispatch_interval_s, and the live service's min_run_before_preemption_s, min_resize_interval_s and
fair_share_half_life_s. Prints per job the live and simulated start and JCT and their difference, the mean absolute
and the worst error in seconds and in % of the live JCT, and the order jobs started in each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


from harness.ports import free_port  # noqa: E402
from harness.simulated_cluster import SimulatedCluster  # noqa: E402
from ringmaster.api.server import BackgroundServer  # noqa: E402
from ringmaster.service.client import RingmasterClient  # noqa: E402
from ringmaster.service.dispatcher import LIVE_RESIZES  # noqa: E402
from ringmaster.service.scheduling.model import PolicyName  # noqa: E402
from ringmaster.service.scheduling.plan import plan  # noqa: E402
from ringmaster.service.settings import Settings  # noqa: E402
from ringmaster.service.simulation.engine import ClusterShape, JobOutcome, Simulation  # noqa: E402
from ringmaster.service.simulation.settings import parse_settings  # noqa: E402
from ringmaster.service.simulation.trace import TraceJob, read_trace  # noqa: E402

CALIBRATION_SLEEP_S = 5.0
CPUS_PER_NODE = 2  # for nothing of the jobs' (a GPU worker's bundle and a driver take no CPU): Ray's own tasks
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
# The work a script-mode worker does: sleep its trace duration, scaled linearly to the size it was given.
SLEEP_SCRIPT = "import os, time; time.sleep({work} / int(os.environ['WORLD_SIZE']))"


# On a loaded machine the Ray dashboard and its modules may take longer than Ray's 60 s and 30 s to start (then the
# head fails to start).
os.environ.setdefault("RAY_DASHBOARD_STARTUP_TIMEOUT_S", "300")
os.environ.setdefault("RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT", "300")


@dataclass(frozen=True)
class LiveJob:
    job_id: str
    submitted: float  # seconds from the trace's start, as the service recorded them (its QUEUED event)
    admitted: float
    running: float
    ended: float
    state: str
    workers: int

    @property
    def jct(self) -> float:
        return self.ended - self.submitted


def script_spec(job: TraceJob, name: str) -> dict[str, Any]:
    work = job.duration * job.gpus
    return {
        "name": name,
        "command": ["python", "-c", SLEEP_SCRIPT.format(work=f"{work:g}")],
        "workers": {"min": job.min_gpus or job.gpus, "max": job.gpus, "gpus_per_worker": 1},
        "priority": job.priority,
        "max_failures": 0,
    }


def _moment(text: str) -> float:
    moment = datetime.fromisoformat(text)
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _first(events: list[dict[str, Any]], states: set[str]) -> dict[str, Any] | None:
    return next((event for event in events if event["to_state"] in states), None)


def read_live(client: RingmasterClient, job_id: str, name: str, origin: float) -> LiveJob:
    events = client.events(job_id)["items"]
    queued, admitted, running = (_first(events, {state}) for state in ("QUEUED", "ADMITTED", "RUNNING"))
    ended = _first(events, TERMINAL)
    if queued is None or admitted is None or running is None or ended is None:
        raise RuntimeError(f"job {name} ({job_id}) lacks an event: {[event['to_state'] for event in events]}")
    return LiveJob(
        job_id=name,
        submitted=_moment(queued["at"]) - origin,
        admitted=_moment(admitted["at"]) - origin,
        running=_moment(running["at"]) - origin,
        ended=_moment(ended["at"]) - origin,
        state=ended["to_state"],
        workers=int((admitted.get("data") or {}).get("world_size") or 0),
    )


def wait_all(client: RingmasterClient, ids: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for job_id in ids:
        while client.job(job_id)["state"] not in TERMINAL:
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} not finished after {timeout_s:.0f} s")
            time.sleep(0.5)


def calibrate(client: RingmasterClient, sizes: list[int]) -> list[float]:
    """Each calibration job's overhead: its JCT alone on the idle cluster less its sleep."""
    overheads = []
    for index, size in enumerate(sizes):
        job = TraceJob(job_id=f"calibrate-{index}", submit_time=0.0, duration=CALIBRATION_SLEEP_S, gpus=size)
        origin = time.time()
        submitted = client.submit(script_spec(job, job.job_id))
        wait_all(client, [submitted["id"]], timeout_s=300)
        measured = read_live(client, submitted["id"], job.job_id, origin)
        if measured.state != "SUCCEEDED":
            raise RuntimeError(
                f"calibration job {index} ended {measured.state}: {client.job(submitted['id'])['error']}"
            )
        overheads.append(measured.jct - CALIBRATION_SLEEP_S)
        print(f"calibration job of {size} worker(s): JCT {measured.jct:.2f} s, overhead {overheads[-1]:.2f} s")
    return overheads


def replay(client: RingmasterClient, jobs: tuple[TraceJob, ...], timeout_s: float) -> list[LiveJob]:
    """Submit each job at its submit time (relative to now), wait for all, and read their events."""
    ids: dict[str, str] = {}
    origin = time.time()
    for job in sorted(jobs, key=lambda job: job.submit_time):
        delay = origin + job.submit_time - time.time()
        if delay > 0:
            time.sleep(delay)
        ids[job.job_id] = client.submit(script_spec(job, f"live-{job.job_id}"))["id"]
        print(f"t={time.time() - origin:6.1f} s  submitted {job.job_id}", flush=True)
    wait_all(client, list(ids.values()), timeout_s)
    return [read_live(client, ids[job.job_id], job.job_id, origin) for job in jobs]


def run_live(args: argparse.Namespace, jobs: tuple[TraceJob, ...]) -> tuple[list[LiveJob], list[float], Settings]:
    with tempfile.TemporaryDirectory(prefix="sim-vs-live-") as scratch:
        cluster = SimulatedCluster(
            nodes=args.nodes, cpus_per_node=CPUS_PER_NODE, gpus_per_node=args.gpus_per_node, logical_gpus=True
        )
        try:
            settings = Settings(
                data_dir=Path(scratch) / "ringmaster",
                ray_address=cluster.gcs_address,
                ray_dashboard_url=cluster.dashboard_url,
                api_port=free_port(),
                driver_python=sys.executable,
                code_path=str(REPO),
                warm_workers_per_node=0,  # GPU workers are never pooled
                scheduling_policy=args.policy,
            )
            with BackgroundServer(settings) as server:
                client = server.client()
                overheads = calibrate(client, args.calibration_sizes)
                live = replay(client, jobs, timeout_s=args.timeout_s)
        finally:
            cluster.shutdown()
    return live, overheads, settings


def run_simulated(
    jobs: tuple[TraceJob, ...],
    live: list[LiveJob],
    overhead_s: float,
    args: argparse.Namespace,
    live_settings: Settings,
) -> dict[str, JobOutcome]:
    submitted = {job.job_id: job.submitted for job in live}
    trace = tuple(
        replace(job, submit_time=round(submitted[job.job_id], 3), duration=job.duration + overhead_s) for job in jobs
    )
    names = [
        f"scheduling_interval_s={live_settings.dispatch_interval_s}",
        f"min_run_s={live_settings.min_run_before_preemption_s}",
        f"min_resize_interval_s={live_settings.min_resize_interval_s}",
        f"fair_share_half_life_s={live_settings.fair_share_half_life_s}",
        f"restart_s={overhead_s:.3f}",
        f"running_resizes={int(LIVE_RESIZES)}",
    ]
    print("simulator settings:", " ".join(names), f"(durations + {overhead_s:.2f} s)")
    settings = parse_settings(names)
    cluster = ClusterShape(args.nodes, args.gpus_per_node, float(CPUS_PER_NODE))
    run = Simulation(trace, cluster, settings, PolicyName(args.policy), plan).run()
    return {outcome.job_id: outcome for outcome in run.jobs}


def report(jobs: tuple[TraceJob, ...], live: list[LiveJob], simulated: dict[str, JobOutcome]) -> dict[str, Any]:
    header = (
        f"{'job':<4} {'gpus':>4} {'min':>3} {'prio':>4} {'dur s':>6} {'submit':>7} "
        f"{'live admit':>10} {'RUNNING':>7} {'sim start':>9} {'live size':>9} {'live JCT':>8} {'sim JCT':>8} "
        f"{'diff s':>7} {'diff %':>7}"
    )
    print(header)
    print("-" * len(header))
    rows: list[dict[str, Any]] = []
    by_id = {job.job_id: job for job in jobs}
    for measured in live:
        trace, sim = by_id[measured.job_id], simulated[measured.job_id]
        diff = sim.completion_time - measured.jct
        rows.append(
            {
                "job": measured.job_id,
                "live": measured.__dict__ | {"jct": measured.jct},
                "sim_start": sim.first_started_at,
                "sim_jct": sim.completion_time,
                "sim_grows": sim.grows,
                "sim_shrinks": sim.shrinks,
                "diff_s": diff,
            }
        )
        print(
            f"{measured.job_id:<4} {trace.gpus:>4} {trace.min_gpus or trace.gpus:>3} {trace.priority:>4} "
            f"{trace.duration:>6.0f} {measured.submitted:>7.1f} {measured.admitted:>10.1f} {measured.running:>7.1f} "
            f"{sim.first_started_at:>9.1f} "
            f"{measured.workers:>9} {measured.jct:>8.1f} {sim.completion_time:>8.1f} {diff:>+7.1f} "
            f"{100 * diff / measured.jct:>+6.1f}%"
        )
    errors = [abs(row["diff_s"]) for row in rows]
    percents = [abs(row["diff_s"]) / row["live"]["jct"] * 100 for row in rows]
    worst = max(rows, key=lambda row: abs(row["diff_s"]))
    worst_pct = max(rows, key=lambda row: abs(row["diff_s"]) / row["live"]["jct"])
    print(
        f"mean absolute error {statistics.mean(errors):.1f} s ({statistics.mean(percents):.1f} %); worst "
        f"{worst['job']} {abs(worst['diff_s']):.1f} s; worst in % {worst_pct['job']} {max(percents):.1f} %"
    )
    live_order = [job.job_id for job in sorted(live, key=lambda job: job.admitted)]
    sim_order = sorted(simulated, key=lambda job_id: (simulated[job_id].first_started_at, job_id))
    print(
        "started, live:      ",
        " ".join(f"{job.job_id}@{job.admitted:.0f}" for job in sorted(live, key=lambda j: j.admitted)),
    )
    print(
        "started, simulated: ", " ".join(f"{job_id}@{simulated[job_id].first_started_at:.0f}" for job_id in sim_order)
    )
    print("same order:", live_order == sim_order)
    return {
        "rows": rows,
        "mean_abs_error_s": statistics.mean(errors),
        "mean_abs_error_pct": statistics.mean(percents),
        "worst_error_s": abs(worst["diff_s"]),
        "worst_error_pct": max(percents),
        "live_order": live_order,
        "sim_order": sim_order,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=REPO / "examples" / "traces" / "live_check.csv")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gpus-per-node", type=int, default=2)
    parser.add_argument("--policy", choices=[policy.value for policy in PolicyName], default="elastic")
    parser.add_argument("--calibration-sizes", type=int, nargs="*", default=[2, 1, 2])
    parser.add_argument("--timeout-s", type=float, default=900.0, help="for the whole trace to finish, live")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument(
        "--live-json", type=Path, help="simulate again against the live run an earlier --json wrote, without a live run"
    )
    args = parser.parse_args()

    jobs = read_trace(args.trace, args.nodes * args.gpus_per_node).jobs
    if args.live_json is not None:
        earlier = json.loads(args.live_json.read_text())
        fields = {name for name in LiveJob.__dataclass_fields__}
        live = [LiveJob(**{name: row["live"][name] for name in fields}) for row in earlier["rows"]]
        overheads = earlier["overheads_s"]
        live_settings = Settings(scheduling_policy=args.policy, **earlier.get("live_settings", {}))
    else:
        live, overheads, live_settings = run_live(args, jobs)
    overhead_s = statistics.mean(overheads[1:] or overheads)
    failed = [job.job_id for job in live if job.state != "SUCCEEDED"]
    if failed:
        raise SystemExit(f"live jobs did not succeed: {failed}")
    observed = []
    for job in live:
        trace = next(item for item in jobs if item.job_id == job.job_id)
        work = trace.duration * trace.gpus / max(job.workers, 1)
        held = job.ended - job.admitted
        observed.append(held - work)
        print(
            f"live {job.job_id}: queued {job.admitted - job.submitted:6.1f} s, admitted→RUNNING "
            f"{job.running - job.admitted:5.1f} s, held {held:6.1f} s at {job.workers} worker(s) "
            f"= work {work:.0f} s + {held - work:.1f} s"
        )
    simulated = run_simulated(jobs, live, overhead_s, args, live_settings)
    figures = report(jobs, live, simulated)
    # What the error would be with the overhead the trace's own jobs showed (held − work, their mean), not the
    # calibration's: how much of the error is the start overhead growing under load.
    print(f"again with the trace's own mean overhead, {statistics.mean(observed):.2f} s:")
    again = report(jobs, live, run_simulated(jobs, live, statistics.mean(observed), args, live_settings))
    if args.json is not None:
        kept = ("dispatch_interval_s", "min_run_before_preemption_s", "min_resize_interval_s", "fair_share_half_life_s")
        document = {
            "overheads_s": overheads,
            "overhead_s": overhead_s,
            "live_settings": {name: getattr(live_settings, name) for name in kept},
            **figures,
            "with_observed_overhead": {"overhead_s": statistics.mean(observed), **again},
        }
        args.json.write_text(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
