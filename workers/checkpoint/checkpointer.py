"""The trainer's checkpoints: where a run resumes from, the save in flight, commit and retention, and their timing.

Asynchronous saves write over a gloo group of their own: the training group's collectives must not interleave with
the background thread's. It also carries rank 0's choice of resume point. One save is in flight at a time (each
waits for the last), so its staging buffers are reused from one save to the next.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from ringmaster.service.reports import CheckpointRecord, StoredCheckpoint
from ringmaster.service.spec import JobSpec
from ringmaster.workers.checkpoint.durable import (
    CommittedCheckpoint,
    PendingSave,
    begin_save,
    checkpoint_dir,
    checkpoint_metrics,
    commit_save,
    find_resume_point,
    load_checkpoint,
)
from ringmaster.workers.checkpoint.snapshots.restore import restore_from_peers
from ringmaster.workers.checkpoint.snapshots.store import SnapshotRef, SnapshotStore
from ringmaster.workers.checkpoint.storage import CheckpointStorage
from ringmaster.workers.checkpoint.training_state import checkpoint_stager
from ringmaster.workers.data.stream import DataPosition
from ringmaster.workers.metric_ledger import RankMetrics
from ringmaster.workers.strategies import ParallelModel

if TYPE_CHECKING:
    # Only named here: the trainer imports this module, and importing the trainer's package from it would be a cycle.
    from ringmaster.workers.trainer.context import TrainContext


@dataclass(frozen=True)
class Restored:
    """Where the run continues: the step and data position (0 and the start without a usable checkpoint)."""

    step: int
    position: DataPosition
    uri: str | None


class Checkpointer:
    def __init__(self, spec: JobSpec, ctx: TrainContext, parallel: ParallelModel, metrics: RankMetrics) -> None:
        self._spec = spec
        self._ctx = ctx
        self._parallel = parallel
        self._metrics = metrics
        self._async_group: dist.ProcessGroup | None = None  # made at the first asynchronous save (_save_group)
        self._stager = checkpoint_stager(ctx.device)
        self._in_flight: PendingSave | None = None
        self._timing: dict[str, tuple[float, float]] = {}  # path -> (when its save began, seconds training was blocked)
        self.saved_step = 0  # the step of the newest save begun (or resumed from)
        self.latest_uri: str | None = None

    def restore(self) -> Restored:
        """Collective: load the newest usable checkpoint (this job's, else resume_from's) and replay the metric
        points it kept; rank 0 reports what it restored and the corrupt checkpoints it skipped."""
        if self._ctx.resume_snapshot is not None:
            return self._restore_from_snapshot(self._ctx.resume_snapshot)
        latest, corrupt = self._agreed_resume_point()
        restored = Restored(0, DataPosition(), None)
        ctx = self._ctx
        if latest is not None:
            began = time.perf_counter()
            progress = load_checkpoint(
                latest.path, model_parts=self._parallel.parts, optimizers=self._parallel.optimizers
            )
            restored = Restored(progress.step, progress.position, latest.path)
            if ctx.rank == 0:
                restore_s = time.perf_counter() - began
                ctx.sink.event(
                    f"restored checkpoint step {restored.step} in {restore_s:.2f}s",
                    {"restored_step": restored.step, "restore_s": round(restore_s, 4), "source": "storage"},
                )
        if corrupt and ctx.rank == 0:
            resumed = f"resumed from step {latest.step}" if latest is not None else "started from scratch"
            problems = "; ".join(
                f"checkpoint step {skipped.step} is corrupt ({problem})" for skipped, problem in corrupt
            )
            ctx.sink.event(
                f"{problems}; {resumed}",
                {
                    "corrupt_checkpoints": [
                        {"step": skipped.step, "uri": skipped.path, "problem": problem} for skipped, problem in corrupt
                    ],
                    "resumed_from_step": latest.step if latest is not None else 0,
                },
            )
        # This job's own history only, not resume_from's.
        if latest is not None and ctx.rank == 0 and latest.path == checkpoint_dir(ctx.storage_root, latest.step):
            self._metrics.replay(checkpoint_metrics(latest))
        self.saved_step, self.latest_uri = restored.step, restored.uri
        return restored

    def _restore_from_snapshot(self, ref: SnapshotRef) -> Restored:
        """Collective: continue from the snapshot the driver chose, moved between peers' memory; rank 0 reports how
        long it took, the bytes moved and the storage reads made (every rank's, summed: none is expected)."""
        ctx = self._ctx
        # Timed from when every rank is here, as a restore from storage is (after the ranks agree on its checkpoint):
        # each builds its model first, and one may come later than the others.
        group = self._restore_group()
        dist.barrier(group=group)
        began, reads_before = time.perf_counter(), CheckpointStorage.reads
        progress, metrics, received = restore_from_peers(
            cast(SnapshotStore, ctx.snapshot_store),  # a resume from a snapshot comes with the store that holds it
            ctx.job_id,
            ref,
            group,
            model_parts=self._parallel.parts,
            optimizers=self._parallel.optimizers,
        )
        totals = torch.tensor([CheckpointStorage.reads - reads_before, received], dtype=torch.float64)
        dist.all_reduce(totals, group=group)
        if ctx.rank == 0:
            restore_s = time.perf_counter() - began
            reads, moved = (int(value) for value in totals.tolist())
            ctx.sink.event(
                f"restored step {progress.step} from peers' memory in {restore_s:.2f}s ({moved} bytes moved "
                "between ranks)",
                {
                    "restored_step": progress.step,
                    "restore_s": round(restore_s, 4),
                    "source": "memory",
                    "bytes_moved": moved,
                    "storage_reads": reads,
                    "snapshot_generation": ref.generation,
                },
            )
            self._metrics.replay(metrics)
        # No durable save of this step was made here: the last step's is always written.
        self.saved_step, self.latest_uri = -1, None
        return Restored(progress.step, progress.position, None)

    def due(self, step: int) -> bool:
        """A periodic save is due after this step (the last step's save is the final one)."""
        every = self._spec.checkpoint.every_steps
        return bool(every) and step % every == 0 and step < self._spec.train.steps

    def save(
        self,
        step: int,
        position: DataPosition,
        metric_value: Callable[[], float | None],
        *,
        final: bool,
        asynchronous: bool,
    ) -> str:
        """Collective: begin a save of the state after `step` (in the background when `asynchronous`, committed
        later by `settle`; else written and committed before returning). `metric_value()`: this checkpoint's value
        of checkpoint.keep_best's metric, asked once the previous save is committed."""
        self.settle(block=True)
        value = metric_value()
        began = time.perf_counter()
        pending = begin_save(
            self._ctx.storage_root,
            self._spec,
            step=step,
            position=position,
            model_parts=self._parallel.parts,
            optimizers=self._parallel.optimizers,
            process_group=self._save_group() if asynchronous else None,
            metric_value=value,
            stager=self._stager,
            metrics=self._metrics.for_checkpoint(),
        )
        self._timing[pending.path] = (began, time.perf_counter() - began)
        if asynchronous:
            self._in_flight = pending
        elif self._ctx.rank == 0:
            self._commit(pending, final)
        self.saved_step, self.latest_uri = step, pending.path
        return pending.path

    def before_state_changes(self) -> None:
        """The save in flight must have copied the state before the optimizer changes it."""
        if self._in_flight is not None:
            self._in_flight.wait_staged()

    def settle(self, block: bool) -> None:
        """Commit the save in flight once written (rank 0 reports it then); `block`: wait for it."""
        if self._in_flight is None or not (block or self._in_flight.done()):
            return
        pending, self._in_flight = self._in_flight, None
        pending.wait()
        if self._ctx.rank == 0:
            self._commit(pending, final=False)

    def close(self) -> None:
        self.settle(block=True)
        self._stager.close()
        if self._async_group is not None:
            dist.destroy_process_group(self._async_group)

    def _save_group(self) -> dist.ProcessGroup:
        """The gloo group an asynchronous save runs its collectives in, beside training's, from a thread of its own.
        Collective: made at the first such save, which every rank begins after the same step, so a job that saves
        nothing while it trains keeps no idle group (each gloo group keeps a thread that wakes every 10 ms, which
        preempts training on busy cores)."""
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def _restore_group(self) -> dist.ProcessGroup:
        """A gloo group for the restore's collectives of CPU objects, before training begins: the default group where
        it is gloo, else the asynchronous saves' (made here then, on every rank)."""
        # Training runs in the default group: WORLD is set.
        return cast(dist.ProcessGroup, dist.group.WORLD) if dist.get_backend() == "gloo" else self._save_group()

    def _commit(self, pending: PendingSave, final: bool) -> None:
        """Rank 0: make a written save visible, then report it with what retention did."""
        committed = commit_save(pending)
        started, blocked_s = self._timing.pop(pending.path)
        self._ctx.sink.checkpoint(
            CheckpointRecord(
                step=pending.step,
                uri=committed.path,
                world_size=self._ctx.world_size,
                final=final,
                metric=pending.manifest.get("metric"),
                metric_value=pending.manifest.get("metric_value"),
                best_uri=committed.retention.best,
                deleted_uris=committed.retention.deleted,
                kept=_stored(committed.retention.kept, committed.path),
                blocked_s=round(blocked_s, 4),
                save_s=round(time.perf_counter() - started, 4),
            )
        )

    def _agreed_resume_point(self) -> tuple[CommittedCheckpoint | None, list[tuple[CommittedCheckpoint, str]]]:
        """Rank 0 chooses the checkpoint and the corrupt ones it skipped, and tells every rank, so all load the same
        one and storage is read once."""
        choice: list[Any] = [None]
        if self._ctx.rank == 0:
            latest, corrupt = find_resume_point(self._ctx.storage_root)
            if latest is None and self._ctx.resume_from_root is not None:
                latest, corrupt_there = find_resume_point(self._ctx.resume_from_root)
                corrupt += corrupt_there
            choice = [(latest, corrupt)]
        dist.broadcast_object_list(choice, src=0, group=self._restore_group())
        agreed: tuple[CommittedCheckpoint | None, list[tuple[CommittedCheckpoint, str]]] = choice[0]
        return agreed


def _stored(kept: list[CommittedCheckpoint], committed_path: str) -> list[StoredCheckpoint] | None:
    """What retention kept, for the record; None where a listing of storage missed the save just committed (a
    store whose listings lag its writes), which would otherwise read as that save gone."""
    if committed_path not in {checkpoint.path for checkpoint in kept}:
        return None
    return [
        StoredCheckpoint(
            step=checkpoint.step,
            uri=checkpoint.path,
            world_size=checkpoint.manifest.get("world_size"),
            metric=checkpoint.manifest.get("metric"),
            metric_value=checkpoint.manifest.get("metric_value"),
        )
        for checkpoint in kept
    ]
