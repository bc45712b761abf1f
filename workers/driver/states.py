"""The job driver's states, each a class: the controller (controller.py) takes one transition per iteration.

Starting ──▶ Running ──▶ Finished
Running ──(workers lost, a collective broke)──▶ Recovering ──▶ Placing
Running ──(warm workers ready, stopped at a step)──▶ Resizing ──▶ Placing
Placing ──(waits for capacity)──▶ Placing ──(group formed)──▶ Running
Starting, Placing ──(a member died while the group formed)──▶ Recovering
any ──(the user's code raised, too few workers, a driver error)──▶ Failed
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringmaster.workers.driver.collaborators import TrainingPoll
from ringmaster.workers.driver.worker_group import RankedWorker


@dataclass(frozen=True)
class Starting:
    pass


@dataclass
class Running:
    poll: TrainingPoll
    stopping: bool = False  # asked the group to stop at the next step, to grow or to be preempted
    preempting: bool = False  # ... to be preempted: the attempt ends once the group has saved


@dataclass(frozen=True)
class Recovering:
    lost: list[RankedWorker]
    reason: str
    # Set only when a member died while the group formed: the world size of the last group that trained (0: none
    # yet). The control plane has not heard of that loss as a new one: the job is RECOVERING already, or ADMITTED
    # with its first group never formed.
    world_size_before_forming: int | None = None

    @property
    def while_forming(self) -> bool:
        return self.world_size_before_forming is not None


@dataclass(frozen=True)
class Resizing:
    pass


@dataclass
class Placing:
    """Re-forming: survivors and standbys in hand, `wanted` new workers to start where bundles can be placed."""

    reason: str
    recovering: bool  # after a loss (else growing to returned capacity)
    world_size_before: int
    started: float  # the controller's clock, when the group began re-forming
    waiting_since: float  # ... and when it began waiting for capacity
    standbys: list[RankedWorker] = field(default_factory=list)
    wanted: int = 0


@dataclass(frozen=True)
class Finished:
    """`succeeded`: trained to the end; else the control plane ended the attempt (cancelled, or superseded)."""

    succeeded: bool
    message: str = ""


@dataclass(frozen=True)
class Failed:
    reason: str


State = Starting | Running | Recovering | Resizing | Placing | Finished | Failed
