"""The few Ray calls the driver's decisions make themselves, and the clock they wait on, behind thin facades: the
controller and the failure probe run against fakes in-process (tests/workers/driver/test_controller.py,
tests/workers/driver/test_probe.py), where a wait advances a fake clock and nothing sleeps."""

from __future__ import annotations

import time
from typing import Any, Protocol

import ray
import ray._private.state  # the GCS's record of an actor's death (no public API gives its cause's reason)
from ray.core.generated.common_pb2 import ActorDiedErrorContext  # type: ignore[attr-defined]  # made at import


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class RayFacade(Protocol):
    def kill(self, actor: Any) -> None:
        """End the actor for good (no restart)."""

    def get(self, ref: Any) -> Any: ...

    def wait(self, refs: list[Any], num_returns: int, timeout: float | None) -> tuple[list[Any], list[Any]]: ...

    def died_on_a_live_node(self, actor_id: str) -> bool:
        """Whether Ray recorded the actor dead of its own process's death while its node lives on."""


class LiveRay:
    """The facade on the Ray cluster this process is connected to."""

    def kill(self, actor: Any) -> None:
        ray.kill(actor, no_restart=True)

    def get(self, ref: Any) -> Any:
        return ray.get(ref)

    def wait(self, refs: list[Any], num_returns: int, timeout: float | None) -> tuple[list[Any], list[Any]]:
        return ray.wait(refs, num_returns=num_returns, timeout=timeout)

    def died_on_a_live_node(self, actor_id: str) -> bool:
        """Killed, crashed or out of memory while its node lives on, so its bundle can take a replacement at once.
        Else (a node that died, one Ray has not yet declared dead, a frozen one, or no answer) its node is treated as
        lost."""
        try:
            actor = ray._private.state.actors(actor_id)
        except Exception:
            return False
        cause = actor.get("DeathCause")
        if actor.get("State") != "DEAD" or cause is None or cause.WhichOneof("context") != "actor_died_error_context":
            return False
        died_itself: bool = cause.actor_died_error_context.reason == ActorDiedErrorContext.Reason.WORKER_DIED
        return died_itself
