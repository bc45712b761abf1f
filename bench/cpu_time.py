"""The machine's CPU time, read from /proc/stat, for the benchmarks' CPU-seconds-per-training-step figures.

Why the whole machine and not the run's own processes (/proc/<pid>/stat, utime+stime, plus cutime+cstime for the
children a process has reaped): a Ray raylet ignores SIGCHLD, so the kernel reaps its dead workers and their CPU
time is added to no one's cutime. A pool worker killed as its job ends, a job driver, a runtime-env agent: whatever
ends inside a measured window would take its CPU time with it, and ringmaster's figure would come out too low.
/proc/stat's counters include every process that ran, whenever it started or ended, and the kernel's own work for
them (loopback TCP between the ranks, softirqs). The price is that anything else running on the machine counts
too: compare runs made beside the same background (both of bench/overhead.py's runs have the same idle Ray cluster
and control plane beside them, and it prints that background's rate), on an otherwise quiet machine.
"""

from __future__ import annotations

import bisect
import os
import threading
import time

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds the machine's cores have spent busy since boot: user, nice, system, irq, softirq and steal from
    the aggregate "cpu" line of /proc/stat (guest time is already inside user and nice; idle and iowait are not)."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()
    assert fields[0] == "cpu", fields
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICKS_PER_S


class BusySampler:
    """Samples machine_busy_seconds() with the wall clock (time.time()) every interval_s in a daemon thread, so the
    CPU time between two moments seen elsewhere (a rank's metric wall_time, a job event) can be read afterwards."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self._times: list[float] = []
        self._busy: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> "BusySampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        now, busy = time.time(), machine_busy_seconds()
        with self._lock:
            self._times.append(now)
            self._busy.append(busy)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def busy_at(self, moment: float) -> float:
        """The machine's busy CPU seconds at wall time `moment`, linearly between the samples either side of it."""
        with self._lock:
            times, busy = list(self._times), list(self._busy)
        if not times[0] <= moment <= times[-1]:
            raise ValueError(f"{moment:.3f} lies outside the sampled span {times[0]:.3f}..{times[-1]:.3f}")
        after = bisect.bisect_left(times, moment)
        if times[after] == moment or after == 0:
            return busy[after]
        before = after - 1
        share = (moment - times[before]) / (times[after] - times[before])
        return busy[before] + share * (busy[after] - busy[before])

    def busy_between(self, start: float, end: float) -> float:
        """CPU seconds the machine spent busy between two wall times (a moment just past the last sample is waited for)."""
        while time.time() < end + self.interval_s * 2 and not self._stop.is_set():
            time.sleep(self.interval_s)
        return self.busy_at(end) - self.busy_at(start)
