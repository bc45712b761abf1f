"""Snapshots copied to peers at every step: the sharded path (FSDP, ZeRO, pipeline and tensor parallel, hybrid), where
a rank alone holds part of the state and only a copy on another node protects it."""

from __future__ import annotations

import torch

from ringmaster.workers.checkpoint.snapshots.group_snapshots import GroupSnapshots
from ringmaster.workers.checkpoint.snapshots.layout import SnapshotLayout
from ringmaster.workers.checkpoint.snapshots.step_snapshots import StepEnd
from ringmaster.workers.checkpoint.snapshots.store import SnapshotRef, snapshot_location
from ringmaster.workers.data.stream import DataPosition


class PeerSnapshots(GroupSnapshots):
    """One group's snapshots: taken after every step, a rank's unique part copied to `replicas` buddies (the
    replicated items a rank holds kept by one rank on each of as many nodes). Collective to construct.

    The first snapshot, and the first after the state changes structure on any rank, is a full DCP save that makes
    the group's layout; the next ones reuse it: each rank fills its shard files from the live state's views (the part
    the next forward may change at once, the rest in the background while the next step runs) and sends its unique
    part to its buddies, with no DCP planning."""

    def end_step(self, end: StepEnd) -> bool:
        # The vote on the state's structure is on the state the optimizer step leaves, so the step's all-reduce
        # that carries it follows the update; the snapshot of the step follows the all-reduce.
        end.update()
        self._changed_anywhere = end.reduce(self.structure_changed())
        stop = end.close()
        if not end.last:
            self.take(end.step, end.position, end.metrics(), changed_anywhere=self._changed_anywhere)
        return stop

    def _take_with_layout(self, ref: SnapshotRef, position: DataPosition, metrics: str | None) -> None:
        values, layout = self._step_values(ref.step, position, metrics), self._agreed_layout
        location, contents = snapshot_location(self._job_id, ref), []
        for file in layout.files:
            content = self._file_of_step(file, values, self._buffers.allocator(location, file.name))
            file.copy_live(content, at_boundary=True)
            contents.append(content)
        self._in_flight = self._executor.submit(self._write_reusing, location, layout, contents)

    def _write_reusing(self, location: str, layout: SnapshotLayout, contents: list[torch.Tensor]) -> None:
        for file, content in zip(layout.files, contents, strict=True):
            file.copy_live(content, at_boundary=False)
        self._share(location, contents, layout.metadata)

    def _replicated_item_copies(self) -> int:
        return len(self._buddy_offsets) + 1  # the buddies' copies and the own one

    def _shared(self, location: str) -> None:
        self._count_completed(location)
