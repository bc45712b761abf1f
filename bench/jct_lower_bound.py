"""A lower bound on the mean job completion time that ANY schedule can reach on a trace and cluster: what a policy's
figures in `ringmaster simulate` could at best be (a benchmark of the workload, not of ringmaster).

    python bench/jct_lower_bound.py TRACE --gpus G [--slot-s 10] [--protect-priority-after-s S ...]

A time-indexed linear program (solved with SciPy's HiGHS): x[j, t] is the GPU-seconds job j runs in slot t (of
--slot-s seconds), at most its requested GPUs at a time, none before its submit, the cluster's G GPUs in all, every
job its whole work (duration × GPUs). A job that runs at most g GPUs and ends at C has a mean busy time (the mean
of t over its work) of at most C - duration / 2, so C_j ≥ sum_t t·slot·x[j, t] / work_j + duration_j / 2, and the
LP's minimum of the mean of those, less the submits, bounds every schedule's mean JCT from below. The bound is
generous to the schedule: it knows every duration, preempts and resizes for free (no restart, no lost work, down to
any size), ignores minimum sizes, node boundaries and the pass interval.

--protect-priority-after-s S adds what `elastic` promises a job of priority > 0 (issue 47: it takes capacity from
lower priorities): it starts within S seconds of its submit and holds at least its min_gpus (its GPUs, if not
elastic) until it ends, which is no sooner than its submit plus its duration; so the bound has it hold them in every
slot between S seconds after its submit and its submit plus its duration. One bound is printed per S given, beside
the free one.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from ringmaster.service.simulation.trace import TraceJob, read_trace


def mean_jct_lower_bound(
    jobs: tuple[TraceJob, ...], gpus: int, slot_s: float, protect_priority_after_s: float | None = None
) -> float:
    """The least mean JCT over every schedule of `jobs` on `gpus` GPUs (see the module's docstring), in seconds."""
    # No schedule ends later than: the last submit, then every job's work one after another on the whole cluster.
    horizon = max(job.submit_time for job in jobs) + sum(job.duration * job.gpus for job in jobs) / gpus
    horizon += max(job.duration for job in jobs)
    slots = math.ceil(horizon / slot_s) + 2
    job_of, slot_of, cost, lower, upper = [], [], [], [], []
    for index, job in enumerate(jobs):
        work = job.duration * job.gpus
        held = job.min_gpus or job.gpus
        for slot in range(int(job.submit_time // slot_s), slots):
            job_of.append(index)
            slot_of.append(slot)
            cost.append(slot * slot_s / work)
            upper.append(job.gpus * slot_s)
            begins, ends = slot * slot_s, (slot + 1) * slot_s
            protected = (
                protect_priority_after_s is not None
                and job.priority > 0
                and begins >= job.submit_time + protect_priority_after_s
                and ends <= job.submit_time + job.duration  # it cannot end sooner: it runs until then at least
            )
            lower.append(held * slot_s if protected else 0.0)
    variables = len(job_of)
    ones = np.ones(variables)
    each_job = coo_matrix((ones, (job_of, range(variables))), shape=(len(jobs), variables)).tocsr()
    each_slot = coo_matrix((ones, (slot_of, range(variables))), shape=(slots, variables)).tocsr()
    result = linprog(
        cost,
        A_ub=each_slot,
        b_ub=np.full(slots, gpus * slot_s),
        A_eq=each_job,
        b_eq=[job.duration * job.gpus for job in jobs],
        bounds=list(zip(lower, upper, strict=True)),
        method="highs",
    )
    if result.status != 0:
        raise SystemExit(f"no schedule meets these constraints: {result.message}")
    return float((result.fun + sum(job.duration / 2 - job.submit_time for job in jobs)) / len(jobs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--gpus", type=int, required=True, help="the cluster's GPUs (nodes × GPUs per node)")
    parser.add_argument("--slot-s", type=float, default=10.0, help="the LP's time step: shorter is tighter, slower")
    parser.add_argument("--protect-priority-after-s", type=float, nargs="*", default=[])
    arguments = parser.parse_args()
    reading = read_trace(arguments.trace, arguments.gpus)
    left_out = ", ".join(f"{count} {cause}" for cause, count in reading.unusable.items())
    print(f"{arguments.trace}: {len(reading.jobs)} jobs{f' (left out: {left_out})' if left_out else ''}")
    print(f"on {arguments.gpus} GPUs, slots of {arguments.slot_s:g} s, every schedule's mean JCT is at least:")
    free = mean_jct_lower_bound(reading.jobs, arguments.gpus, arguments.slot_s)
    print(f"  {free:9.0f} s ({free / 60:6.1f} min)  with free preemption and resizing, priorities ignored")
    for after_s in arguments.protect_priority_after_s:
        bound = mean_jct_lower_bound(reading.jobs, arguments.gpus, arguments.slot_s, after_s)
        protected = f"each priority > 0 job holding its min GPUs from {after_s:g} s after its submit"
        print(f"  {bound:9.0f} s ({bound / 60:6.1f} min)  {protected}")


if __name__ == "__main__":
    main()
