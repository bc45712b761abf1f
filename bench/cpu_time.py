"""CPU time read from /proc, for the benchmarks' CPU-seconds-per-training-step figures: two readings of one clock.

- machine: the whole machine's busy CPU time (/proc/stat). Every process that ran counts, whenever it started or
  ended, and so does the kernel's own work for them (the ranks' loopback TCP, softirqs); so does anything else
  running on the machine, which only a quiet machine keeps out.
- tree: the benchmark's own process and every process below it (/proc/<pid>/stat, utime+stime), which is the whole
  run: a control plane started in-process, the Ray head it starts (its raylet, workers and job drivers all descend
  from it), a torchrun launched beside it. Other users' processes do not count. Reading each process's counters
  once before and once after a window is not enough: a raylet ignores SIGCHLD, so the kernel reaps its dead workers
  and their CPU time is added to no one's cutime, and a worker killed as its job ends would take its CPU time with
  it. So a ProcessTree keeps the last counters it saw of every member, alive or dead, and BusySampler reads it every
  0.25 s: what a process spends after its last reading, or a process that lives less than that, is missed, as is
  kernel time charged to no process; the machine reading has those. A reading takes a few milliseconds (one
  listing of /proc, one read per member), spent in the benchmark's own process and so counted in both runs alike.

On a quiet machine the two readings agree to within those misses; where others share the machine, the tree is the
one to compare.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from dataclasses import dataclass

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds the machine's cores have spent busy since boot: user, nice, system, irq, softirq and steal from
    the aggregate "cpu" line of /proc/stat (guest time is already inside user and nice; idle and iowait are not)."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()
    assert fields[0] == "cpu", fields
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICKS_PER_S


def process_stat(pid: int) -> tuple[int, int, float] | None:
    """(parent pid, start time in ticks, utime+stime in seconds) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            after_name = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(after_name[1]), int(after_name[19]), (int(after_name[11]) + int(after_name[12])) / _TICKS_PER_S


class ProcessTree:
    """The CPU seconds a process and its descendants have used, counting each process seen once as a member for
    good: one that ends keeps the counters of its last reading (see the module docstring)."""

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self._spent: dict[tuple[int, int], float] = {}  # (pid, start time): a member's last utime+stime
        self._strangers: set[int] = set()  # pids seen that are not below the root: not read again
        self.seconds()  # the first reading looks at every process on the machine; later ones at members and new pids

    def seconds(self) -> float:
        """Read every member's counters now (and admit the processes started below a member since the last call)."""
        seen: dict[int, tuple[int, int, float]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in self._strangers and (stat := process_stat(int(entry))) is not None:
                seen[int(entry)] = stat
        alive: set[int] = set()
        # Parents start before their children: in start order, a new process's parent is decided before it.
        for pid, (parent, started, spent) in sorted(seen.items(), key=lambda item: (item[1][1], item[0])):
            key = (pid, started)
            if key in self._spent or pid == self.root or parent in alive:
                self._spent[key] = spent
                alive.add(pid)
            else:
                self._strangers.add(pid)  # (a pid reused below the root within one benchmark would be missed)
        return sum(self._spent.values())


@dataclass(frozen=True)
class Cpu:
    """CPU seconds in the two readings: the whole machine's and the benchmark's process tree's."""

    machine: float
    tree: float

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(self.machine - other.machine, self.tree - other.tree)

    def __truediv__(self, steps: float) -> Cpu:
        return Cpu(self.machine / steps, self.tree / steps)


class CpuClock:
    """Both readings at once; the tree is this process's unless another root is given."""

    def __init__(self, root: int | None = None) -> None:
        self._tree = ProcessTree(root)

    def read(self) -> Cpu:
        return Cpu(machine=machine_busy_seconds(), tree=self._tree.seconds())


class BusySampler:
    """Reads a CpuClock every interval_s in a daemon thread, with the wall clock (time.time()), so the CPU time between
    two moments seen elsewhere (a rank's metric wall_time, a job event) can be read afterwards."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self._clock = CpuClock()
        self._times: list[float] = []
        self._readings: list[Cpu] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> BusySampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        now, reading = time.time(), self._clock.read()
        with self._lock:
            self._times.append(now)
            self._readings.append(reading)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def at(self, moment: float) -> Cpu:
        """Both readings at wall time `moment`, linearly between the samples either side of it."""
        with self._lock:
            times, readings = list(self._times), list(self._readings)
        if not times[0] <= moment <= times[-1]:
            raise ValueError(f"{moment:.3f} lies outside the sampled span {times[0]:.3f}..{times[-1]:.3f}")
        after = bisect.bisect_left(times, moment)
        if times[after] == moment or after == 0:
            return readings[after]
        before, after_reading = readings[after - 1], readings[after]
        share = (moment - times[after - 1]) / (times[after] - times[after - 1])
        return Cpu(
            before.machine + share * (after_reading.machine - before.machine),
            before.tree + share * (after_reading.tree - before.tree),
        )

    def between(self, start: float, end: float) -> Cpu:
        """CPU seconds spent between two wall times (waiting for a sample past `end` if there is none yet)."""
        while time.time() < end + self.interval_s * 2 and not self._stop.is_set():
            time.sleep(self.interval_s)
        return self.at(end) - self.at(start)
