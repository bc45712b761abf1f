"""Sends the driver's reports to the control plane; buffers and replays while it is unreachable.

Replays are safe because the control plane upserts metrics by step and checkpoints by URI. Each answer says
whether the attempt is still the job's live one: once it is not (the job was cancelled, or a newer attempt took
over), `ended` is set and the driver stops on its own, without waiting for Ray to deliver the stop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, cast

import httpx

from ringmaster.service.reports import CheckpointRecord, DriverReport, MetricPoint, RankMemory

log = logging.getLogger(__name__)


class Reporter:
    def __init__(
        self, api_url: str, job_id: str, attempt: int, token: str | None = None, flush_interval_s: float = 0.5
    ) -> None:
        self._url = f"{api_url.rstrip('/')}/v1/internal/jobs/{job_id}/attempts/{attempt}/report"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(headers=headers, timeout=5.0)
        self._pending: deque[DriverReport] = deque()
        self._seq = 0  # per attempt: the control plane skips a report it has applied (a replay)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._interval = flush_interval_s
        self.handled_seq = 0  # every report up to this one was answered: stored, or refused for good (4xx)
        self.ended = threading.Event()  # the control plane ignores this attempt now
        self.ended_state: str | None = None  # the job's state when it said so
        self.preempting = threading.Event()  # the control plane asks this attempt to save and stop
        self.preempted_for: str | None = None  # ... for this job (None: its node is draining)
        self._thread = threading.Thread(target=self._flush_loop, name="reporter", daemon=True)
        self._thread.start()

    def report(
        self,
        *,
        state: str | None = None,
        message: str | None = None,
        metrics: list[MetricPoint] | None = None,
        checkpoints: list[CheckpointRecord] | None = None,
        memory: list[RankMemory] | None = None,
        details: dict[str, Any] | None = None,
    ) -> int:
        """Queue a report; returns its sequence number (compare with `handled_seq`)."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            report = DriverReport(
                seq=seq,
                state=state,
                message=message,
                details=details or {},
                metrics=metrics or [],
                checkpoints=checkpoints or [],
                memory=memory or [],
            )
            self._pending.append(report)
        self._wake.set()
        return seq

    def _flush_loop(self) -> None:
        while not self._closed:
            self._wake.wait(self._interval)
            self._wake.clear()
            self._flush()

    def _flush(self) -> bool:
        """Send pending reports in order; stop at the first failure and keep it for the next try."""
        while True:
            with self._lock:
                if not self._pending:
                    return True
                report = self._pending[0]
            try:
                response = self._client.post(
                    self._url, content=report.model_dump_json(), headers={"Content-Type": "application/json"}
                )
            except httpx.HTTPError as error:
                log.warning("control plane unreachable, keeping %d report(s): %s", len(self._pending), error)
                return False
            if response.status_code >= 500:
                log.warning("control plane answered %s, will retry", response.status_code)
                return False
            if response.status_code >= 400:
                log.error("control plane refused a report (%s): %s", response.status_code, response.text[:500])
            else:
                self._read_ack(response)
            with self._lock:
                self._pending.popleft()
                self.handled_seq = cast(int, report.seq)  # report() numbers every report it queues

    def _read_ack(self, response: httpx.Response) -> None:
        try:
            ack = response.json()
        except ValueError:
            return
        if ack.get("preempting") and not self.preempting.is_set():
            self.preempted_for = ack.get("preempted_for")
            self.preempting.set()
            log.warning("the control plane preempts this attempt (for job %s): saving and stopping", self.preempted_for)
        if ack.get("accepted") is False and not self.ended.is_set():
            self.ended_state = ack.get("state")
            self.ended.set()
            log.warning("the control plane no longer takes this attempt's reports (job %s)", self.ended_state)

    def close(self, timeout_s: float = 30.0) -> bool:
        """Flush what is left, retrying until timeout_s; True when everything was delivered."""
        self._closed = True
        self._wake.set()
        self._thread.join()
        deadline = time.monotonic() + timeout_s
        delivered = self._flush()
        while not delivered and time.monotonic() < deadline:
            time.sleep(0.5)
            delivered = self._flush()
        self._client.close()
        return delivered
