"""What a rank's trainer is given (where it runs, one line to its driver) and what it hands back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ringmaster.service.reports import CheckpointRecord, MetricPoint, RankMemory
from ringmaster.workers.checkpoint.snapshots.store import SnapshotRef, SnapshotStore


class ProgressSink(Protocol):
    """The rank's one line to its driver. Out: metric points, committed checkpoints and events (rank 0), and each
    rank's memory report. Back: whether the driver asked the group to stop, and how many of the metric points sent
    in this training call the control plane has stored (workers/metric_ledger.py)."""

    def metric(self, point: MetricPoint) -> None: ...
    def checkpoint(self, record: CheckpointRecord) -> None: ...
    def event(self, message: str, details: dict[str, Any]) -> None: ...
    def memory(self, measured: RankMemory) -> None: ...
    def stop_requested(self) -> bool: ...
    def metrics_acknowledged(self) -> int: ...


class NullSink:
    """A sink for a run nobody watches: everything is dropped, nothing is ever asked or acknowledged."""

    def metric(self, point: MetricPoint) -> None:
        pass

    def checkpoint(self, record: CheckpointRecord) -> None:
        pass

    def event(self, message: str, details: dict[str, Any]) -> None:
        pass

    def memory(self, measured: RankMemory) -> None:
        pass

    def stop_requested(self) -> bool:
        return False

    def metrics_acknowledged(self) -> int:
        return 0


_NULL_SINK = NullSink()  # stateless: one instance serves every context given no sink


@dataclass(frozen=True)
class TrainContext:
    """Where this rank runs (the process group already exists) and its line to the driver."""

    rank: int
    world_size: int
    device: torch.device
    job_id: str
    storage_root: str
    sink: ProgressSink = _NULL_SINK
    # Workers on each node, in rank order (ranks are contiguous per node); None: all on one node.
    ranks_per_node: tuple[int, ...] | None = None
    # Which formation of the group this is (the driver re-forms it after failures and to grow).
    generation: int = 0
    # Another job's storage root (JobSpec.resume_from): resumed from while this job has no usable checkpoint.
    resume_from_root: str | None = None
    # The job attempt this run serves: the metric points a checkpoint keeps name it.
    attempt: int = 1
    # This process's in-memory snapshots (workers/checkpoint/snapshots/), kept across the groups it joins; None: none.
    snapshot_store: SnapshotStore | None = None
    # The snapshot the driver chose to resume from (the members hold it between them); None: from storage.
    resume_snapshot: SnapshotRef | None = None


@dataclass(frozen=True)
class TrainResult:
    """How the attempt ended: ``loss`` is the last step's global mean (None if this attempt ran no
    step), ``val_loss`` is None when stopped early or without a validation set."""

    step: int
    loss: float | None
    val_loss: float | None
    checkpoint_uri: str | None
    stopped: bool
