"""Rank 0's metric points on their way to the control plane, and the one acknowledgement path back.

A point travels rank 0 → its worker actor (drained every second) → the driver → the reporter → the API. A driver
that dies, or a control plane that is down, may leave points unstored, so each checkpoint keeps every point not yet
acknowledged, however old, and an attempt that resumes from it replays them. The acknowledgement comes back the same
way, as one number: how many of this training call's points, counted in the order rank 0 recorded them, the control
plane has answered for.

- ``RankMetrics`` (rank 0, in the training loop): numbers each point, keeps the unacknowledged ones for the next
  checkpoint, and replays a checkpoint's points under the attempt that ran them.
- ``DrainedMetrics`` (the driver): which report carried how many points, and so how many are acknowledged as of the
  reporter's ``handled_seq``; the driver passes that count to rank 0's worker at each drain.

The worker actor only carries the count across (``TrainWorker.drain``). A training call's count starts at zero: a
worker that joins a new group starts a new call, which resumes from a checkpoint that kept the older points.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from typing import Any

from ringmaster.service.reports import MetricPoint


class RankMetrics:
    """Rank 0's side of the ledger for one training call."""

    def __init__(
        self,
        attempt: int,
        send: Callable[[MetricPoint], None],
        acknowledged: Callable[[], int],
        keep_for_checkpoints: bool,
    ) -> None:
        """`send` passes a point towards the driver; `acknowledged()` is how many sent points the control plane has
        answered for. Without periodic checkpoints nothing is kept: there is nothing to resume from mid-run."""
        self._attempt = attempt
        self._send = send
        self._acknowledged = acknowledged
        self._keep = keep_for_checkpoints
        self._sent = 0
        # (position in send order, point as stored, its JSON): encoded once, as in-memory snapshots keep the
        # unacknowledged points at every step
        self._unacknowledged: deque[tuple[int, dict[str, Any], str]] = deque()
        self._held: MetricPoint | None = None  # recorded, kept, not yet sent (record's hold)

    def record(self, point: MetricPoint, *, hold: bool = False) -> None:
        """Send `point`, and keep it for checkpoints until acknowledged. `hold`: send it only at `release`, so that
        a later point of its step (the step's validation) goes with it as one point: sent apart, the stream would have
        passed the step's row before its val_loss arrived. A point of the held point's step merges into it, the user's
        metrics too (the validation's val_<name> beside the step's own)."""
        if self._held is not None and self._held.step == point.step and self._held.attempt == point.attempt:
            merged = self._held.model_dump(exclude_none=True) | point.model_dump(exclude_none=True)
            if self._held.user_metrics and point.user_metrics:
                merged["user_metrics"] = self._held.user_metrics | point.user_metrics
            self._held = point = MetricPoint.model_validate(merged)
            if self._keep:
                position = self._unacknowledged.pop()[0]
                self._keep_point(position, point)
            return
        self.release()
        position, self._sent = self._sent, self._sent + 1
        if self._keep:
            self._keep_point(position, point)
        if hold:
            self._held = point
        else:
            self._send(point)

    def release(self) -> None:
        """Send the held point, if any."""
        if self._held is not None:
            held, self._held = self._held, None
            self._send(held)

    def _keep_point(self, position: int, point: MetricPoint) -> None:
        stored = {"attempt": self._attempt} | point.model_dump(exclude_none=True)  # a replayed point keeps its attempt
        self._unacknowledged.append((position, stored, json.dumps(stored)))

    def replay(self, points: list[dict[str, Any]]) -> None:
        """Points a resumed checkpoint kept: sent again, and kept again until acknowledged."""
        for point in points:
            self.record(MetricPoint.model_validate(point))

    def for_checkpoint(self) -> list[dict[str, Any]]:
        """The points a checkpoint saved now must keep: every one not yet acknowledged, in order."""
        return [point for _, point, _ in self._kept()]

    def for_checkpoint_json(self) -> str:
        """``for_checkpoint`` as one JSON array, joined from each point's encoding."""
        return "[" + ", ".join(encoded for _, _, encoded in self._kept()) + "]"

    def _kept(self) -> deque[tuple[int, dict[str, Any], str]]:
        acknowledged = self._acknowledged()
        while self._unacknowledged and self._unacknowledged[0][0] < acknowledged:  # positions rise in send order
            self._unacknowledged.popleft()
        return self._unacknowledged


class DrainedMetrics:
    """The driver's side of the ledger: how many of rank 0's points each report carried."""

    def __init__(self) -> None:
        self._forwarded = 0
        self._reports: deque[tuple[int, int]] = deque()  # (report seq, points forwarded up to and including it)
        self._acknowledged = 0

    def restart(self) -> None:
        """A new training call: rank 0 counts its points from zero again."""
        self._forwarded, self._acknowledged = 0, 0
        self._reports.clear()

    def forwarded(self, report_seq: int, count: int) -> None:
        if count:
            self._forwarded += count
            self._reports.append((report_seq, self._forwarded))

    def acknowledged(self, handled_seq: int) -> int:
        """Points of this call the control plane has answered for, once every report up to `handled_seq` was."""
        while self._reports and self._reports[0][0] <= handled_seq:
            self._acknowledged = self._reports.popleft()[1]
        return self._acknowledged
