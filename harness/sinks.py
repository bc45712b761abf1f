"""A ProgressSink made of plain callbacks, for tests and benchmarks that run a Trainer without a driver."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _ignore(_: Any) -> None:
    pass


def _ignore_event(message: str, details: dict[str, Any]) -> None:
    pass


@dataclass
class CallbackSink:
    on_metric: Callable[[Any], None] = _ignore
    on_checkpoint: Callable[[Any], None] = _ignore
    on_event: Callable[[str, dict[str, Any]], None] = _ignore_event
    on_memory: Callable[[Any], None] = _ignore
    should_stop: Callable[[], bool] = lambda: False
    metrics_confirmed: Callable[[], int] = lambda: 0

    def metric(self, point: Any) -> None:
        self.on_metric(point)

    def checkpoint(self, record: Any) -> None:
        self.on_checkpoint(record)

    def event(self, message: str, details: dict[str, Any]) -> None:
        self.on_event(message, details)

    def memory(self, measured: Any) -> None:
        self.on_memory(measured)

    def stop_requested(self) -> bool:
        return self.should_stop()

    def metrics_acknowledged(self) -> int:
        return self.metrics_confirmed()
