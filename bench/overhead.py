"""What ringmaster costs over bare torchrun, for the same model, world size and steps.

    python bench/overhead.py [--workers 2] [--steps 600] [--rounds 5] [--model tiny-gpt|hf-gpt2] [--without-ray-loops]
                              [--code DIR [--code-only]] [--script]

(a) trains tiny-gpt (--model hf-gpt2: `model: hf:GPT2LMHeadModel`, a 2-block GPT-2) through ringmaster: REST submit →
queue → Ray job → worker actors;
(b) trains it with bench/bare_torchrun.py under torchrun, beside the same idle Ray cluster and
control plane;
(c) runs the same bare_torchrun.py loop inside plain Ray actors (threaded, as ringmaster's workers are) on that
cluster: what hosting the ranks in Ray worker processes costs by itself, with no ringmaster code in the way;
(d) has the same actors run the loop in a child process each (a plain Python process, as torchrun's ranks are), as
ringmaster's workers train (workers/rank_process.py): what a rank gains when its actor only supervises the process
that trains.
Each round runs a and b next to each other, b first in even rounds and a first in odd ones, so a slow spell of the
machine (one run's steps/s moves by ±15% here) falls on both more often than when other runs sit between them, and a
drift within a round favours neither; then c and d (--without-ray-loops leaves them out, for more rounds in the
time). Prints steady-state steps/s of each (wall clock between step ends, first --skip-steps left out), each round's
ratio a/b, and their median (goal ≥ 0.97) with every round's ratio,
and submit-to-first-step time on a warm cluster (goal ≤ 5 s): one whose warm pool
(RINGMASTER_WARM_WORKERS_PER_NODE, default 2) has refilled since the last job. With
RINGMASTER_WARM_WORKERS_PER_NODE=0 every job starts cold workers.

With --code DIR, each round then also submits the same tiny-gpt job with that directory as its code (as
`ringmaster submit --code DIR` does: packed, uploaded over REST unless stored already, handed to Ray as the job's
working_dir) twice, and prints each one's submit-to-first-step (goal ≤ 5 s on a warm cluster). A job with its own
runtime env never takes a shared pool worker; the control plane keeps a pool of its own for the few envs jobs most
recently ran in (RINGMASTER_WARM_RUNTIME_ENVS). "pooled": the job's env has such a pool, refilled since the job
before; "cold": the same code with an environment variable no job had (a new runtime env), so its workers start
cold in the cached package. The warm-up before the rounds has uploaded the package and unpacked it on the node.
--code-only measures just these two.

With --script (script mode, docs/jobs/script-mode.md), (a) is the script (b) runs under torchrun,
bench/bare_torchrun.py, submitted unchanged as a script job (`command: [python, bench/bare_torchrun.py, …]`, the same
arguments, workers {min: N, max: N, cpus_per_worker: 1}): each worker runs it as a process of its own with torchrun's
environment, and its rank 0 reports the loss of every step with ringmaster.report (a no-op under torchrun), which the
driver forwards to the control plane. The script also reports rank 0's own process's CPU seconds per steady step, in
both runs (rank0_cpu_s_per_step). Both runs' steps/s, steady span and first step come from the script's own
JSON line (read from the job's log under ringmaster), so they are measured the same way; (c) and (d) are left out.
The warm-up is a script job too; script workers take no warm-pool worker, so each job starts its worker actors and
then the script's processes (which import torch): submit→first step is printed beside torchrun's own launch→first
step of the same script in the same round, and their difference (first_step_added_over_torchrun_s_median) is what
ringmaster adds to the start.

Measured (2-core machine shared with other sessions' tests, whose load kept both cores busy throughout: the idle
machine reading was 2.0 CPU s/s; tiny-gpt, 2 workers, 600 steps; docs/benchmarks.md has every printed line):
`nice -n 19 python bench/overhead.py --script` (5 rounds): ratio 0.874 (rounds 0.804 0.874 0.69 1.097 0.927), CPU
s/step steady, tree: 0.0399 bare, 0.0482 ringmaster (1.205); submit→first step median 19.11 s against torchrun's
launch→first step 13.27 s of the same script, 3.61 s added. `--rounds 3`, at a lower load: ratio 0.872, tree 1.204,
rank 0's own process 0.0150 bare, 0.0162 ringmaster CPU s/step; first step 11.58 s against 8.52 s, 3.04 s added.
Neither goal (ratio ≥ 0.97, first step ≤ 5 s) is met on that machine; docs/benchmarks.md says where the CPU beside
the ranks went and why the script alone takes more than 5 s to its first step there.

The Ray head is configured as `ringmaster serve` starts one (Ray's default interval between metrics exports), not
as the tests start theirs. The script asks for the job's state (GET /v1/jobs/{id}) every --poll-s seconds while it
trains, as a script polling the API would (each request takes CPU on the same two cores). `ringmaster watch` and the
web page read the job's event stream instead, which cost the server more than this poll here: 26 against 15 ms/s with
and without one stream reader, for a job reporting every second (a stand-in cluster, not this script).

Wall clock swings between rounds on a shared machine (0.78-1.21 for the same pair here), so each round also
prints the CPU seconds per training step of each run, which a slow spell changes far less, in bench/cpu_time.py's
two readings, sampled every 0.25 s in a thread of this process: "tree", this script's process and every process
below it (the control plane runs in it; the Ray head with its raylet, workers and job drivers, and torchrun with
its ranks, are its children), and "machine", the whole machine's busy CPU time (bench/cpu_time.py says what each
misses or adds). Each is taken between two moments and divided by the steps between them. "steady": from the end
of step --skip-steps to the end of the last step, the span the steps/s figures use (bare_torchrun.py reports its
wall times; ringmaster's are its metrics' wall_time); "whole run": from starting torchrun to its exit, and from the
submit to the job's SUCCEEDED event, start-up included (the warm pool's refill after the job falls outside it).
Both runs count the same idle Ray cluster and control plane beside them (their rate is printed each round,
measured for 3 s before the bare run), so the difference between the runs is ringmaster's work for the job: its
driver, reports, heartbeats, the dispatcher and the polled API. The machine reading also counts whatever else runs
on the machine; where others share it, compare the tree's. Printed with the medians over rounds and the median of
each round's ratio ringmaster/bare.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bare_torchrun import HF_GPT2_OPTIONS, SEQ_LEN  # noqa: E402
from bench.cpu_time import BusySampler, Cpu  # noqa: E402
from harness.local_control_plane import CLUSTER_CPUS, running_control_plane, stop_test_head, wait_for_state  # noqa: E402
from harness.ports import free_port  # noqa: E402
from ringmaster.service.client import RingmasterClient  # noqa: E402
from ringmaster.service.embedded_ray import RayHead, start_head  # noqa: E402
from ringmaster.service.settings import Settings  # noqa: E402
from ringmaster.service.spec import SHARED_POOL, JobSpec  # noqa: E402

IDLE_SAMPLE_S = 3.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny-gpt", "hf-gpt2"], default="tiny-gpt")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--poll-s", type=float, default=1.0, help="How often the job's state is asked for.")
    parser.add_argument("--skip-steps", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument(
        "--code",
        type=Path,
        help="Also time submit-to-first-step of the job shipped with this "
        "directory as its code (e.g. examples/project).",
    )
    parser.add_argument(
        "--code-steps", type=int, default=20, help="Steps of each --code job (only its start is timed)."
    )
    parser.add_argument(
        "--code-only", action="store_true", help="Only the --code jobs' starts, no steady-state rounds."
    )
    parser.add_argument(
        "--script",
        action="store_true",
        help="Script mode: bare_torchrun.py itself run unchanged "
        "as a script job (JobSpec.command) against the same script under torchrun; implies --without-ray-loops.",
    )
    parser.add_argument(
        "--without-ray-loops",
        action="store_true",
        help="Leave out (c) and (d), the bare loop in Ray "
        "actors and in their child processes: only ringmaster against torchrun, in shorter rounds.",
    )
    return parser.parse_args()


@dataclass(frozen=True)
class CpuPerStep:
    """CPU seconds per training step of one run, in both readings."""

    steady: Cpu  # from the end of step --skip-steps to the end of the last step
    whole_run: Cpu  # from the run's start to its end, start-up included

    @staticmethod
    def measure(
        sampler: BusySampler, args: argparse.Namespace, run: tuple[float, float], steady: tuple[float, float]
    ) -> CpuPerStep:
        """`run` and `steady`: (start, end) wall times."""
        return CpuPerStep(
            steady=sampler.between(*steady) / (args.steps - args.skip_steps),
            whole_run=sampler.between(*run) / args.steps,
        )


def bare_torchrun(args: argparse.Namespace, sampler: BusySampler) -> tuple[float, CpuPerStep, float, float]:
    """Steady steps/s, the CPU per step, seconds from launching torchrun to the end of step 1, and rank 0's own
    process's CPU seconds per steady step."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.workers}",
        str(REPO / "bench" / "bare_torchrun.py"),
        *_bare_loop_argv(args),
    ]
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    ended = time.time()
    if result.returncode != 0:
        raise SystemExit(f"bare torchrun failed ({result.returncode}):\n{result.stderr[-4000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    cpu = CpuPerStep.measure(sampler, args, (started, ended), tuple(report["steady_wall"]))
    return report["steps_per_s_steady"], cpu, report["first_step_wall"] - started, report["rank0_cpu_s_per_step"]


@ray.remote(num_cpus=0, max_concurrency=2)  # holds no CPU: the ringmaster job's bundles must still fit
class BareRank:
    """A plain threaded Ray actor that runs bare_torchrun.py's loop as one rank."""

    def __init__(self) -> None:
        os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun sets it
        sys.path.insert(0, str(REPO))
        import bench.bare_torchrun  # noqa: F401 — torch and transformers imported before the first round

    def run_in_child(self, argv: list[str], env: dict[str, str]) -> str:
        """The loop in a child process of this actor, with the actor's environment and import path."""
        child_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(sys.path)}
        result = subprocess.run(
            [sys.executable, str(REPO / "bench" / "bare_torchrun.py"), *argv],
            env=child_env,
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        if result.returncode != 0:
            raise RuntimeError(f"bare loop in a child process failed ({result.returncode}):\n{result.stderr[-4000:]}")
        return result.stdout

    def run(self, argv: list[str], env: dict[str, str]) -> str:
        from bench import bare_torchrun

        os.environ.update(env)
        sys.argv = ["bare_torchrun.py", *argv]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            bare_torchrun.main()
        return out.getvalue()


BARE_LOOP_TIMEOUT_S = 600.0


def _bare_loop_argv(args: argparse.Namespace) -> list[str]:
    """bare_torchrun.py's arguments for the run this bench measures, the same under torchrun and in Ray actors."""
    return [
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--skip-steps",
        str(args.skip_steps),
        "--global-batch-size",
        str(args.global_batch_size),
        "--micro-batch-size",
        str(args.micro_batch_size),
    ]


def bare_in_ray_actors(args: argparse.Namespace, ranks: list, in_child: bool = False) -> float:
    """Steady steps/s of bare_torchrun.py's loop run by `ranks` (BareRank actors, one per worker): in the actors'
    own processes, or (`in_child`) in a child process of each."""
    argv = _bare_loop_argv(args)
    meeting = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(len(ranks))}
    runs = [
        (rank.run_in_child if in_child else rank.run).remote(
            argv, {**meeting, "RANK": str(index), "LOCAL_RANK": str(index)}
        )
        for index, rank in enumerate(ranks)
    ]
    try:
        outputs = ray.get(runs, timeout=BARE_LOOP_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        # Seen once: one actor was idle while the other stayed in native code under bare_torchrun.main() for over
        # 10 minutes; a round that never ends is an error, not a hang.
        raise SystemExit(
            f"the bare loop in Ray actors ({'child processes' if in_child else 'in the actors'}) did not end "
            f"within {BARE_LOOP_TIMEOUT_S:.0f}s"
        ) from None
    return json.loads(outputs[0].strip().splitlines()[-1])["steps_per_s_steady"]


def job_spec(args: argparse.Namespace, name: str, steps: int) -> dict:
    return {
        "name": name,
        "strategy": "ddp",
        **(
            {"model": "hf:GPT2LMHeadModel", "model_options": {**HF_GPT2_OPTIONS, "seq_len": SEQ_LEN}}
            if args.model == "hf-gpt2"
            else {"model": "tiny-gpt"}
        ),
        "workers": {"min": args.workers, "max": args.workers, "cpus_per_worker": 1},
        "train": {
            "steps": steps,
            "global_batch_size": args.global_batch_size,
            "micro_batch_size": args.micro_batch_size,
            "lr": 0.001,
            "seed": 0,
        },
        "checkpoint": {"every_steps": 0, "keep": 1},
    }


def script_job_spec(args: argparse.Namespace, name: str, steps: int) -> dict:
    """bare_torchrun.py as a script job, with the arguments torchrun runs it with."""
    argv = _bare_loop_argv(args)
    argv[argv.index("--steps") + 1] = str(steps)
    return {
        "name": name,
        "command": ["python", str(REPO / "bench" / "bare_torchrun.py"), *argv],
        "workers": {"min": args.workers, "max": args.workers, "cpus_per_worker": 1},
        "max_failures": 0,
    }


def script_report(client: RingmasterClient, job_id: str) -> dict:
    """The JSON line rank 0 of bare_torchrun.py printed, from the job's log (`[rank 0] {...}`)."""
    logs = client.logs(job_id)
    for line in reversed(logs.splitlines()):
        if line.startswith("[rank 0] {"):
            return json.loads(line.removeprefix("[rank 0] "))
    raise SystemExit(f"script job {job_id} printed no report; its log ends:\n{logs[-3000:]}")


def wait_for_warm_pool(workers: int, pool: str = SHARED_POOL, timeout_s: float = 180.0) -> float:
    """Seconds until `workers` idle workers of `pool` are warm and no pool worker is still starting (one importing
    torch beside a measured start would slow it)."""
    from ringmaster.workers.warm_pool import pool_workers

    started = time.monotonic()
    while True:
        statuses = pool_workers()
        ready = sum(
            status["warm"] and status["claimant"] is None
            for name, status in statuses.items()
            if name.split(":")[1] == pool
        )
        if ready >= workers and all(status["warm"] for status in statuses.values()):
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise SystemExit(f"fewer than {workers} warm workers in pool {pool} within {timeout_s:.0f}s: {statuses}")
        time.sleep(0.25)


def code_job_first_step(
    client: RingmasterClient, args: argparse.Namespace, name: str, env_vars: dict[str, str] | None = None
) -> tuple[float, dict, dict]:
    """Seconds from the start of `submit --code` (packing and upload included) to the end of step 1, where they
    went, and the job."""
    submitted = time.time()
    spec = job_spec(args, name, args.code_steps)
    if env_vars:
        spec["runtime_env"] = {"env_vars": env_vars}
    job = client.submit(spec, code=args.code)
    uploaded = time.time() - submitted
    done = wait_for_state(client, job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout_s=600, poll_s=args.poll_s)
    if done["state"] != "SUCCEEDED":
        raise SystemExit(f"--code job {job['id']} ended {done['state']}: {done['error']}")
    first = next(row["wall_time"] for row in client.metrics(job["id"])["items"] if row["step"] == 1)
    events = client.events(job["id"])["items"]
    moments = {
        event["to_state"]: datetime.fromisoformat(event["at"]).timestamp() - submitted
        for event in events
        if event["to_state"] in ("ADMITTED", "RUNNING")
    }
    running = next(event for event in events if event["to_state"] == "RUNNING")
    return (
        first - submitted,
        {
            "packed_and_submitted_s": round(uploaded, 2),
            "admitted_s": round(moments["ADMITTED"], 2),
            "group_formed_s": round(moments["RUNNING"], 2),
            "warm_pool_workers": running["data"]["warm_pool_workers"],
        },
        job,
    )


def code_round(client: RingmasterClient, args: argparse.Namespace, round_index: int, pool: str) -> tuple[float, float]:
    """Submit-to-first-step of the --code job in its env's warm pool, then of the same code in a new env (cold)."""
    pooled_workers = args.workers if Settings().warm_workers_per_node and Settings().warm_runtime_envs else 0
    wait_for_warm_pool(pooled_workers, pool)
    pooled, phases, _ = code_job_first_step(client, args, f"overhead-code-{round_index}")
    print(f"round {round_index}: --code {args.code} pooled: submit→first step {pooled:.2f} s {phases}", flush=True)
    wait_for_warm_pool(pooled_workers, pool)  # the same quiet machine for the cold one
    cold, phases, _ = code_job_first_step(
        client, args, f"overhead-code-cold-{round_index}", env_vars={"BENCH_NEW_ENV": f"{time.time_ns()}"}
    )
    print(
        f"round {round_index}: --code {args.code} cold (new env): submit→first step {cold:.2f} s {phases}", flush=True
    )
    return pooled, cold


def through_ringmaster(
    client: RingmasterClient, args: argparse.Namespace, name: str, sampler: BusySampler
) -> tuple[float, float, dict, CpuPerStep]:
    """Steady steps/s from the steps' wall times, seconds from submit to the end of step 1, where they went, and
    the CPU per step."""
    submitted = time.time()
    job = client.submit((script_job_spec if args.script else job_spec)(args, name, args.steps))
    done = wait_for_state(client, job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"}, timeout_s=600, poll_s=args.poll_s)
    if done["state"] != "SUCCEEDED":
        raise SystemExit(f"job {job['id']} ended {done['state']}: {done['error']}")
    if args.script:
        # The script's own figures, measured as under torchrun; steps 1 and --skip-steps stand for their wall times.
        report = script_report(client, job["id"])
        steady = report["steps_per_s_steady"]
        times = {1: report["first_step_wall"], args.skip_steps: report["steady_wall"][0]}
        times[args.steps] = report["steady_wall"][1]
        rank0_cpu = report["rank0_cpu_s_per_step"]
    else:
        times = {
            row["step"]: row["wall_time"]
            for row in client.metrics(job["id"], limit=10_000)["items"]
            if row["wall_time"]
        }
        steady = (args.steps - args.skip_steps) / (times[args.steps] - times[args.skip_steps])
    events = client.events(job["id"])["items"]
    moments = {
        event["to_state"]: datetime.fromisoformat(event["at"]).timestamp() - submitted
        for event in events
        if event["to_state"] in ("ADMITTED", "RUNNING", "SUCCEEDED")
    }
    running = next(event for event in events if event["to_state"] == "RUNNING")
    phases = {
        "admitted_s": round(moments["ADMITTED"], 2),
        # script mode: the ranks' processes started (RUNNING is reported once every rank's process runs)
        "group_formed_s": round(moments["RUNNING"], 2),
        "first_step_s": round(times[1] - submitted, 2),
        "warm_pool_workers": running["data"].get("warm_pool_workers", 0),
    }
    if args.script:
        phases["rank0_cpu_s_per_step"] = round(rank0_cpu, 4)  # the script's own process, as bare's
    cpu = CpuPerStep.measure(
        sampler, args, (submitted, submitted + moments["SUCCEEDED"]), (times[args.skip_steps], times[args.steps])
    )
    return steady, times[1] - submitted, phases, cpu


def idle_cpu_rate(sampler: BusySampler) -> Cpu:
    """CPU seconds per second with the cluster idle (the background both runs share)."""
    started = time.time()
    time.sleep(IDLE_SAMPLE_S)
    return sampler.between(started, started + IDLE_SAMPLE_S) / IDLE_SAMPLE_S


def _cpu_line(bare: CpuPerStep, managed: CpuPerStep, idle: Cpu) -> str:
    def span(field: str) -> str:
        b, m = getattr(bare, field), getattr(managed, field)
        return (
            f"bare {b.tree:.4f}|{b.machine:.4f}, ringmaster {m.tree:.4f}|{m.machine:.4f}, "
            f"ratio {m.tree / b.tree:.3f}|{m.machine / b.machine:.3f}"
        )

    return (
        f"CPU s/step tree|machine: steady {span('steady')}; whole run {span('whole_run')}; "
        f"idle cluster {idle.tree:.3f}|{idle.machine:.3f} CPU s/s"
    )


def _cpu_summary(bare: list[CpuPerStep], managed: list[CpuPerStep], idle: list[Cpu]) -> dict:
    summary: dict = {}
    for reading in ("tree", "machine"):
        for field in ("steady", "whole_run"):
            b = [getattr(getattr(run, field), reading) for run in bare]
            m = [getattr(getattr(run, field), reading) for run in managed]
            summary[f"cpu_s_per_step_{field}_{reading}"] = {
                "bare_median": round(statistics.median(b), 4),
                "ringmaster_median": round(statistics.median(m), 4),
                "ratio": round(statistics.median(x / y for x, y in zip(m, b)), 3),
            }
        summary[f"idle_cluster_cpu_s_per_s_{reading}_median"] = round(
            statistics.median(getattr(c, reading) for c in idle), 3
        )
    return summary


@contextmanager
def production_head(data_dir: Path) -> Iterator[RayHead]:
    """A head configured as `ringmaster serve` starts one: Ray's own interval between metrics exports (10 s), not the
    tests' 1 s (start_test_head), which has every process of the job export its metrics ten times as often."""
    head = start_head(data_dir / "ray", num_cpus=CLUSTER_CPUS)
    try:
        yield head
    finally:
        stop_test_head(head)


def main() -> None:
    args = parse_args()
    if args.code_only and not args.code:
        raise SystemExit("--code-only needs --code DIR")
    if args.script and args.code:
        raise SystemExit("--script measures the script by its path; --code is managed mode's")
    args.without_ray_loops = args.without_ray_loops or args.script
    bare, managed, ratios, first_step, code_pooled, code_cold = [], [], [], [], [], []
    bare_first_step: list[float] = []  # torchrun's launch to the end of step 1
    rank_cpu: dict[str, list[float]] = {}  # rank 0's own process's CPU s per steady step, from bare_torchrun.py
    in_ray: list[float] = []  # bare_torchrun.py's loop in plain Ray actors
    in_child: list[float] = []  # the same loop in a child process of each of those actors
    bare_cpu: list[CpuPerStep] = []
    managed_cpu: list[CpuPerStep] = []
    idle: list[Cpu] = []
    with tempfile.TemporaryDirectory() as data_dir, BusySampler() as sampler, production_head(Path(data_dir)) as head:
        for server in running_control_plane(Path(data_dir), head=head):
            client = server.client()
            through_ringmaster(
                client, args, "warm-up", sampler
            )  # a warm cluster: worker processes exist, imports cached
            bare_ranks = (
                [] if args.code_only or args.without_ray_loops else [BareRank.remote() for _ in range(args.workers)]
            )
            ray.get([rank.__ray_ready__.remote() for rank in bare_ranks])
            code_pool = None
            if args.code:  # the package is uploaded and unpacked once; its env's pool fills after it
                _, _, job = code_job_first_step(client, args, "warm-up-code")
                code_pool = JobSpec.model_validate(job["spec"]).warm_pool
            for round_index in range(args.rounds):
                if not args.code_only:
                    order = ("bare", "ringmaster") if round_index % 2 == 0 else ("ringmaster", "bare")
                    for run in order:
                        # The pool refills after each job (its workers import torch): each run starts once it is idle.
                        if Settings().warm_workers_per_node:
                            wait_for_warm_pool(args.workers)
                        if run == "bare":
                            idle.append(idle_cpu_rate(sampler))
                            bare_rate, bare_cpu_now, bare_to_first_step, bare_rank_cpu = bare_torchrun(args, sampler)
                            bare_first_step.append(bare_to_first_step)
                            rank_cpu.setdefault("bare", []).append(bare_rank_cpu)
                            bare.append(bare_rate)
                            bare_cpu.append(bare_cpu_now)
                        else:
                            steady, to_first_step, phases, cpu = through_ringmaster(
                                client, args, f"overhead-{round_index}", sampler
                            )
                            managed.append(steady)
                            managed_cpu.append(cpu)
                            if "rank0_cpu_s_per_step" in phases:
                                rank_cpu.setdefault("ringmaster", []).append(phases["rank0_cpu_s_per_step"])
                            first_step.append(to_first_step)
                    ratios.append(steady / bare[-1])
                    print(
                        f"round {round_index} ({' then '.join(order)}): bare {bare[-1]:.2f} steps/s, "
                        f"ringmaster {steady:.2f} steps/s, ratio {ratios[-1]:.3f}, "
                        f"submit→first step {to_first_step:.2f} s {phases} "
                        f"(bare: torchrun's launch→first step {bare_first_step[-1]:.2f} s, "
                        f"rank 0's own CPU s/step {rank_cpu['bare'][-1]:.4f})",
                        flush=True,
                    )
                    print(f"round {round_index}: {_cpu_line(bare_cpu_now, cpu, idle[-1])}", flush=True)
                    if not args.without_ray_loops:
                        in_ray.append(bare_in_ray_actors(args, bare_ranks))
                        in_child.append(bare_in_ray_actors(args, bare_ranks, in_child=True))
                        print(
                            f"round {round_index}: bare loop in plain Ray actors {in_ray[-1]:.2f} steps/s "
                            f"({in_ray[-1] / bare[-1]:.3f} of torchrun); "
                            f"ringmaster over it {steady / in_ray[-1]:.3f}; "
                            f"in a child process of each actor {in_child[-1]:.2f} steps/s "
                            f"({in_child[-1] / bare[-1]:.3f} of torchrun, "
                            f"{in_child[-1] / in_ray[-1]:.3f} of the loop in the actors)",
                            flush=True,
                        )
                if code_pool is not None:
                    pooled, cold = code_round(client, args, round_index, code_pool)
                    code_pooled.append(pooled)
                    code_cold.append(cold)
    summary: dict = {
        "mode": "script" if args.script else "managed",
        "workers": args.workers,
        "rounds": args.rounds,
        "warm_workers_per_node": Settings().warm_workers_per_node,
    }
    if not args.code_only:
        summary.update(
            {
                "steps": args.steps,
                "bare_steps_per_s_median": round(statistics.median(bare), 3),
                "ringmaster_steps_per_s_median": round(statistics.median(managed), 3),
                "ratio": round(statistics.median(ratios), 3),
                "ratio_goal": 0.97,
                "round_ratios": [round(ratio, 3) for ratio in ratios],
                "ratio_of_medians": round(statistics.median(managed) / statistics.median(bare), 3),
                "submit_to_first_step_s_median": round(statistics.median(first_step), 2),
                "submit_to_first_step_goal_s": 5.0,
                # what ringmaster adds to the start: each round's submit→first step minus torchrun's launch→first step
                "bare_launch_to_first_step_s_median": round(statistics.median(bare_first_step), 2),
                "first_step_added_over_torchrun_s_median": round(
                    statistics.median(m - b for m, b in zip(first_step, bare_first_step)), 2
                ),
                **_cpu_summary(bare_cpu, managed_cpu, idle),
                **(
                    {
                        "rank0_cpu_s_per_step_steady": {
                            "bare_median": round(statistics.median(rank_cpu["bare"]), 4),
                            "ringmaster_median": round(statistics.median(rank_cpu["ringmaster"]), 4),
                        }
                    }
                    if "ringmaster" in rank_cpu
                    else {}
                ),
            }
        )
        if in_ray:
            summary.update(
                {
                    "bare_in_ray_actors_steps_per_s_median": round(statistics.median(in_ray), 3),
                    "bare_in_ray_actors_over_torchrun": round(
                        statistics.median(x / y for x, y in zip(in_ray, bare)), 3
                    ),
                    "ringmaster_over_bare_in_ray_actors": round(
                        statistics.median(x / y for x, y in zip(managed, in_ray)), 3
                    ),
                    "bare_in_child_of_actor_over_torchrun": round(
                        statistics.median(x / y for x, y in zip(in_child, bare)), 3
                    ),
                    "bare_in_child_of_actor_over_in_actor": round(
                        statistics.median(x / y for x, y in zip(in_child, in_ray)), 3
                    ),
                }
            )
    if code_pooled:
        summary.update(
            {
                "warm_runtime_envs": Settings().warm_runtime_envs,
                "code_submit_to_first_step_s_median": {
                    "pooled": round(statistics.median(code_pooled), 2),
                    "cold": round(statistics.median(code_cold), 2),
                    "goal": 5.0,
                },
            }
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
