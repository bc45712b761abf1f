"""Snapshots that are the live state itself, where every rank holds the whole model and optimizer state and the
optimizer step runs no collective (ddp): nothing of that state is copied at a step."""

from __future__ import annotations

import pickle
from functools import cached_property
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ringmaster.workers.checkpoint.snapshots.group_snapshots import GroupSnapshots
from ringmaster.workers.checkpoint.snapshots.layout import FileLayout, SnapshotLayout, items_of_step
from ringmaster.workers.checkpoint.snapshots.shard_file import (
    REPLICATED_PART,
    UNIQUE_PART,
    shard_file_with_table,
    shard_name,
    slot_view,
)
from ringmaster.workers.checkpoint.snapshots.step_snapshots import StepEnd
from ringmaster.workers.checkpoint.snapshots.store import (
    METADATA_NAME,
    FileMadeWhenRead,
    SnapshotRef,
    snapshot_location,
)
from ringmaster.workers.checkpoint.snapshots.transport import FileGather
from ringmaster.workers.data.stream import DataPosition
from ringmaster.workers.torch_internals import foreach_copy_


class LiveStateSnapshots(GroupSnapshots):
    """One group's snapshots where a rank's live state is its snapshot of the step it last completed. Collective to
    construct.

    Before the optimizer step, `begin_snapshot` sends every rank's own items of the coming step's snapshot (its RNG
    states, rank 0's metric points: its unique part) to every rank; after it, `complete_snapshot` names the live
    state the rest of that snapshot (a LiveFile). Whichever peer fails when, a survivor that completed the step holds
    the whole snapshot of its state, and one that did not still holds the one before; the driver's choice then takes
    the newest (a step no one redoes). A full DCP save (`take`) makes the layout after a change of structure."""

    # The same construction as GroupSnapshots'; what this kind adds starts empty.
    live_step: int | None = None  # the step the live state is the snapshot of, if any
    _begun: tuple[int, DefaultSavePlanner] | None = None  # the step begin_snapshot began, its own values
    _layout_intact_since_update: SnapshotLayout | None = None  # what complete_snapshot found, if no update since

    @cached_property
    def _gather(self) -> FileGather:
        return FileGather(self.group)

    def end_step(self, end: StepEnd) -> bool:
        # The step's all-reduce comes before the update, with the vote on the state's structure as the last update
        # left it, so rank 0's metric point of this step is in what begin_snapshot sends every rank; the update then
        # makes the live state the rest of this step's snapshot. The step time of the point so ends before the update.
        self._changed_anywhere = end.reduce(self.structure_changed())
        stop = end.close()
        self.begin_snapshot(end.step, end.position, end.metrics(), changed_anywhere=self._changed_anywhere)
        end.update()
        self.complete_snapshot(end.step)
        if self._changed_anywhere and not end.last:
            self.take(end.step, end.position, end.metrics(), changed_anywhere=True)  # a full save: a new layout
        return stop

    def structure_changed(self) -> bool:
        self.wait()
        if self._layout is not None and self._layout is self._layout_intact_since_update:
            return False  # complete_snapshot found this structure, and no update has run since
        return super().structure_changed()

    def begin_snapshot(
        self, step: int, position: DataPosition, metrics: str | None = None, *, changed_anywhere: bool
    ) -> None:
        """Before the optimizer step that completes step `step` (collective): every rank's UNIQUE_PART file of
        snapshot `step` (its RNG states, rank 0's metric points) goes to every rank, in one all-gather; from here the
        live state is no longer the last snapshot's. After a change of structure (`changed_anywhere`: the group's
        vote of structure_changed before the step), nothing is gathered: a full save (`take`) follows the step."""
        self.wait()
        self._begun, self._layout_intact_since_update = None, None
        if not changed_anywhere:
            values, layout = self._step_values(step, position, metrics), self._agreed_layout
            own = layout.files[UNIQUE_PART]
            location = snapshot_location(self._job_id, SnapshotRef(self._generation, step))
            gathered = self._gather(self._file_of_step(own, values))
            for rank, content in enumerate(gathered):
                self._store.write(location, shard_name(rank, UNIQUE_PART), content)
            self._store.write(location, METADATA_NAME, layout.metadata)
            self._store.retain(self._job_id)
            self._begun = (step, values)
            # The newest whole snapshot is the last step's (reported with what this step's gather sent), while the
            # live state is still its.
            self._count_completed(
                snapshot_location(self._job_id, SnapshotRef(self._generation, self.live_step))
                if self.live_step is not None
                else location
            )
            self.sent_bytes = gathered[self._rank].numel() * (self._world_size - 1)
        self.live_step = None

    def complete_snapshot(self, step: int) -> None:
        """After the optimizer step that completed step `step` (local): the live state is the rest of the snapshot
        `begin_snapshot` began, while its structure is the layout's (else this rank holds no whole snapshot of the
        step, and its vote makes the next one a full save)."""
        begun, self._begun = self._begun, None
        if begun is None or begun[0] != step or self.structure_changed():
            return
        self._layout_intact_since_update = layout = self._agreed_layout
        replicated = layout.files[REPLICATED_PART]
        table, tensors = items_of_step(replicated, begun[1], self._local_optimizers)
        self._store.write(
            snapshot_location(self._job_id, SnapshotRef(self._generation, step)),
            replicated.name,
            LiveFile(self, step, replicated, table, tensors),
        )
        self.live_step = step

    def hold_copies_of_live(self) -> None:
        """Once this group's training ended (a stop, a failure): its snapshots' live files become copies in host
        memory, independent of this group's model (SnapshotStore.hold_copies_of_live)."""
        self._store.hold_copies_of_live(self)

    def training_ended(self, *, stopped: bool) -> None:
        super().training_ended(stopped=stopped)
        if stopped:
            self.hold_copies_of_live()

    def training_failed(self) -> None:
        self.hold_copies_of_live()  # the next group restores from them, with a model of its own

    def _take_with_layout(self, ref: SnapshotRef, position: DataPosition, metrics: str | None) -> None:
        raise RuntimeError(
            f"snapshot of step {ref.step}: of live state, only a change of structure takes a snapshot after the step "
            "(begin_snapshot and complete_snapshot take the others)"
        )

    def _replicated_item_copies(self) -> None:
        return None  # an item every rank holds is kept by every rank: its live state

    def _check_layout(self, layout: SnapshotLayout) -> None:
        unique = layout.files[UNIQUE_PART]
        if unique.live or unique.hyperparameters:
            raise RuntimeError(
                "in-memory snapshots of live state: this rank alone holds part of the model or optimizer "
                "state, which only copies protect (the strategy's state is not replicated)"
            )

    def _shared(self, location: str) -> None:
        pass  # the snapshots of the steady state are the ones begun and completed (begin_snapshot counts them)

    def _spare_buffer_bytes(self, latest_files: dict[str, int]) -> int:
        return 0  # the snapshots of the steady state are begun and completed, with no file written ahead


class LiveFile(FileMadeWhenRead):
    """A rank's REPLICATED_PART shard file of a snapshot whose items every rank holds live: not copied at its step but
    made from the live tensors when read, valid while they still hold the snapshot's step (`owner.live_step`; the
    next optimizer step ends it). What the live tensors do not keep is taken at the step: the byte items (the
    progress, the optimizer's hyperparameters), the step's own tensors, and the module buffers the next forward may
    change."""

    owner: LiveStateSnapshots

    def __init__(
        self,
        owner: LiveStateSnapshots,
        step: int,
        file: FileLayout,
        table: dict[int, Any],
        tensors: dict[int, torch.Tensor],
    ) -> None:
        self.owner, self._step, self._file, self._tensors = owner, step, file, tensors
        self._table = pickle.dumps(table)
        self._buffers = [source.clone() for source in file.live_by_boundary[True][1]]

    def valid(self) -> bool:
        return self.owner.live_step == self._step

    def numel(self) -> int:
        return self._file.tensor_bytes + len(self._table) + 8

    def materialize(self) -> torch.Tensor:
        file = self._file
        content = shard_file_with_table(file.tensor_bytes, self._table)
        views = {key: slot_view(content, slot) for key, slot in enumerate(file.slots) if slot.key is None}
        for key, tensor in self._tensors.items():
            views[key].copy_(tensor)
        for at_boundary, sources in ((True, self._buffers), (False, file.live_by_boundary[False][1])):
            keys = file.live_by_boundary[at_boundary][0]
            if keys:
                foreach_copy_([views[key] for key in keys], sources)
        return content
