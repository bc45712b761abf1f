"""Where the CPU goes that a running job adds beside its ranks: each process of the control plane and the Ray cluster,
read on an idle cluster and then while one job trains, the same warm cluster and control plane both times.

    python bench/support_cpu.py [--rounds 3] [--model hf-gpt2|tiny-gpt] [--workers 2] [--sample-s 20] [--poll-s 1.0]

bench/overhead.py compares steps/s, which swing ±15% from run to run on a shared machine; on a machine whose cores the
ranks fill (2 CPU ranks on 2 cores here), each CPU-second another process takes is one the ranks wait for, so the
CPU-seconds per second the job adds beside its ranks are the overhead's cause, read far more steadily. Each round:
the warm pool refilled, --sample-s seconds of the idle cluster; then a job (bench/overhead.py's) trains, and after its
first steps --sample-s seconds of it, while this script asks for the job's state every --poll-s seconds (as
bench/overhead.py does; not the event stream `ringmaster watch` reads). Prints, per kind of process, CPU milliseconds
per second idle and training (medians over rounds), and their difference; the sum of the differences beside the
ranks, and that sum as a share of the machine's cores.

Read from /proc: utime+stime of every process alive at both ends of a window. A process that starts and ends inside
one (Ray's JobSupervisor forks a `sleep` every second) is missed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cpu_time import process_stat  # noqa: E402
from bench.overhead import job_spec, production_head, wait_for_warm_pool  # noqa: E402
from harness.local_control_plane import running_control_plane, wait_for_state  # noqa: E402

# (what the command line holds, the kind reported), first match wins; Ray names its actors' processes ray::<Class>.
_KINDS = [
    ("ringmaster.workers.rank_process", "ranks"),
    ("ringmaster.workers.driver", "job driver"),
    ("ray::JobSupervisor", "Ray JobSupervisor"),
    ("ray::TrainWorker", "worker actors (the job's and the warm pool's)"),
    ("ray::DashboardAgent", "Ray dashboard agent"),
    ("ray::RuntimeEnvAgent", "Ray runtime env agent"),
    ("ray::IDLE", "idle Ray workers"),
    ("gcs_server", "Ray GCS"),
    ("raylet", "raylet"),
    ("ray-dashboard-", "Ray dashboard modules"),
    ("dashboard.py", "Ray dashboard"),
    ("log_monitor", "Ray log monitor"),
    ("monitor.py", "Ray monitor"),
]
CONTROL_PLANE = "control plane (this process: API, dispatcher, the watcher's requests)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny-gpt", "hf-gpt2"], default="hf-gpt2")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sample-s", type=float, default=20.0)
    parser.add_argument("--poll-s", type=float, default=1.0, help="How often the job's state is asked for.")
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    return parser.parse_args()


def _kind(pid: int) -> str:
    if pid == os.getpid():
        return CONTROL_PLANE
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    return next((kind for marker, kind in _KINDS if marker in command), "other")


def _cpu_by_process() -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, start time) -> (kind, utime+stime seconds) of every process now."""
    readings = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := process_stat(int(entry))) is not None:
            _parent, started, seconds = stat
            readings[(int(entry), started)] = (_kind(int(entry)), seconds)
    return readings


def sample(seconds: float, every_s: float | None = None, action=None) -> dict[str, float]:
    """CPU milliseconds per second of each kind of process over `seconds`, doing `action` every `every_s`."""
    before, started = _cpu_by_process(), time.monotonic()
    while (left := seconds - (time.monotonic() - started)) > 0:
        if action is not None:
            action()
        time.sleep(min(left, every_s or left))
    after, elapsed = _cpu_by_process(), time.monotonic() - started
    spent: dict[str, float] = defaultdict(float)
    for key, (kind, seconds_used) in after.items():
        if key in before:
            spent[kind] += seconds_used - before[key][1]
    return {kind: 1000 * used / elapsed for kind, used in spent.items()}


def main() -> None:
    args = parse_args()
    idle: list[dict[str, float]] = []
    training: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as data_dir, production_head(Path(data_dir)) as head:
        for server in running_control_plane(Path(data_dir), head=head):
            client = server.client()
            for round_number in range(args.rounds):
                wait_for_warm_pool(args.workers)
                time.sleep(3)  # the refilled pool's start-up has settled
                idle.append(sample(args.sample_s))
                # Long enough to outlast the sample; cancelled after it.
                job = client.submit(job_spec(args, f"support-{round_number}", steps=100_000))
                wait_for_state(client, job["id"], {"RUNNING"}, timeout_s=300, poll_s=args.poll_s)
                while not client.metrics(job["id"], limit=1)["items"]:
                    time.sleep(args.poll_s)
                time.sleep(5)  # past the first steps and the pool's refill
                training.append(sample(args.sample_s, args.poll_s, functools.partial(client.job, job["id"])))
                client.cancel(job["id"])
                wait_for_state(
                    client, job["id"], {"CANCELLED", "SUCCEEDED", "FAILED"}, timeout_s=300, poll_s=args.poll_s
                )
                print(
                    f"round {round_number}: beside the ranks, training {_beside_ranks(training[-1]):.1f} ms/s, "
                    f"idle {_beside_ranks(idle[-1]):.1f} ms/s",
                    flush=True,
                )
    kinds = sorted({kind for reading in idle + training for kind in reading})
    rows = {
        kind: (statistics.median(r.get(kind, 0.0) for r in idle), statistics.median(r.get(kind, 0.0) for r in training))
        for kind in kinds
    }
    print(f"{'process':<72} {'idle':>8} {'training':>9} {'added':>8}   (CPU ms per s, medians of {args.rounds} rounds)")
    for kind, (at_rest, busy) in sorted(rows.items(), key=lambda item: item[1][0] - item[1][1]):
        print(f"{kind:<72} {at_rest:>8.1f} {busy:>9.1f} {busy - at_rest:>8.1f}")
    added = statistics.median(_beside_ranks(busy) - _beside_ranks(at_rest) for at_rest, busy in zip(idle, training))
    cores = os.cpu_count() or 1
    print(
        json.dumps(
            {
                "rounds": args.rounds,
                "model": args.model,
                "workers": args.workers,
                "added_beside_ranks_ms_per_s": round(added, 1),
                "cores": cores,
                "added_share_of_cores": round(added / (1000 * cores), 4),
                "ranks_ms_per_s": round(rows.get("ranks", (0, 0))[1], 1),
            }
        )
    )


def _beside_ranks(reading: dict[str, float]) -> float:
    return sum(value for kind, value in reading.items() if kind != "ranks")


if __name__ == "__main__":
    main()
