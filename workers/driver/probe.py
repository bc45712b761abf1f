"""Who is still there (after a failed collective, a node's loss, a member lost while the group formed): a heartbeat
to each worker, and those that answer neither within the timeout nor within the grace of another's answer are lost.

A live worker answers in milliseconds; a dead one's call hangs until Ray declares its node dead, so waiting the whole
timeout for it only delays the recovery. A call that fails (Ray knows its actor is dead) is no answer: how soon Ray
knew says nothing of how soon the live ones answer, so it starts no grace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from ray.exceptions import RayActorError

from ringmaster.workers.driver.ray_facade import Clock, RayFacade

W = TypeVar("W")

# What ended the probe's wait: every call came back, the grace after an answer ran out, or the whole timeout did.
ProbeEnd = Literal["every call", "grace", "timeout"]


@dataclass(frozen=True)
class Probe(Generic[W]):
    lost: list[W]
    ended_by: ProbeEnd


def probe(beats: dict[Any, W], timeout_s: float, grace_s: float, ray: RayFacade, clock: Clock) -> Probe[W]:
    """`beats`: each worker's heartbeat call, already sent."""
    timeout_at = deadline = clock.monotonic() + timeout_s
    lost: list[W] = []
    pending = list(beats)
    while pending and (remaining := deadline - clock.monotonic()) > 0:
        done, pending = ray.wait(pending, 1, remaining)
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError:
                lost.append(beats[ref])
            else:
                deadline = min(deadline, clock.monotonic() + grace_s)
    ended_by: ProbeEnd = "every call" if not pending else "grace" if deadline < timeout_at else "timeout"
    return Probe(lost + [beats[ref] for ref in pending], ended_by)
