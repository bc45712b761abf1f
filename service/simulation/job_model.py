"""How a simulated job runs: its speed at a world size, what a shrink, a grow, a preemption and a restart cost it, and
what a preemption loses. Every figure is a setting; the defaults are this project's own measurements."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ringmaster.service.simulation.errors import SimulationInputError


class Scaling(StrEnum):
    LINEAR = "linear"  # n workers do n/requested of the work per second the requested size does
    AMDAHL = "amdahl"  # speed 1 / (s + (1 − s)/n) with a serial fraction s


@dataclass(frozen=True, slots=True)
class JobModel:
    """The job model's settings (`--setting NAME=VALUE`), each in seconds unless it says otherwise."""

    scaling: Scaling = Scaling.LINEAR
    # Amdahl's serial fraction of a step (only with scaling=amdahl).
    serial_fraction: float = 0.05
    # A planned shrink pauses the job (and the job it makes room for) this long: bench/recovery.py's `shrink` scenario,
    # a worker leaves a 2-worker group which trains on from memory, 0.43–0.45 s over 3 rounds (commit a193a9c).
    shrink_s: float = 0.45
    # A grow pauses the job this long: bench/recovery.py's `replace-spare` scenario, a warm pool worker joins the
    # group, 0.71–0.95 s over 3 rounds (commit a193a9c); the slower figure.
    grow_s: float = 0.95
    # A preemption holds the victim's GPUs this long before the job it makes room for starts: the group stops at a step
    # boundary through the same in-memory path as a shrink (bench/recovery.py `shrink`, 0.45 s).
    preemption_s: float = 0.45
    # A preempted job that starts again pauses this long: a cold start of its workers to the first step,
    # bench/overhead.py --code, 11.35 s (3.64 s from a warm pool; commit 002cc53), the conservative figure.
    restart_s: float = 11.35
    # A job that is not elastic checkpoints every this many seconds of running (0: never, as a JobSpec with
    # checkpoint.every_steps 0); a preemption loses what it ran since.
    checkpoint_interval_s: float = 1800.0
    # 1: a plan may shrink and grow a running job. 0: a running job keeps the size it started at until it ends or is
    # preempted, as on the live dispatcher while service/dispatcher.py's LIVE_RESIZES is off: the plan sees it at that
    # size (so it preempts it whole rather than shrink it) and its grows are not carried out (a script job never
    # resizes while it runs; a managed job's driver growing itself onto idle capacity is not modelled).
    running_resizes: float = 1.0

    def __post_init__(self) -> None:
        if self.running_resizes not in (0.0, 1.0):
            raise SimulationInputError(f"setting running_resizes is 0 or 1, got {self.running_resizes:g}")

    def rate(self, workers: int, requested: int) -> float:
        """Work done per second at `workers` workers, where a job's duration is measured at `requested` workers."""
        if self.scaling is Scaling.LINEAR:
            return workers / requested
        return self._amdahl_speed(workers) / self._amdahl_speed(requested)

    def lost_on_preemption(self, elastic: bool, running_s: float) -> float:
        """Seconds of running a preemption throws away: none for an elastic job (its state is kept in memory and
        resumed with at most one step redone), else what it ran since its last periodic checkpoint."""
        if elastic:
            return 0.0
        if self.checkpoint_interval_s == 0:
            return running_s
        return running_s % self.checkpoint_interval_s

    def _amdahl_speed(self, workers: int) -> float:
        return 1.0 / (self.serial_fraction + (1.0 - self.serial_fraction) / workers)
