"""One group's snapshots, taken after every step and copied to buddies (see this package's docstring)."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.optim import Optimizer

from ringmaster.workers.checkpoint.snapshots.dcp_storage import SnapshotWriter
from ringmaster.workers.checkpoint.snapshots.layout import (
    FileLayout,
    SnapshotLayout,
    fingerprint_of_state,
    fingerprint_of_step_values,
    hyperparameter_sources,
    items_of_step,
    live_storages,
    make_layout,
)
from ringmaster.workers.checkpoint.snapshots.shard_file import (
    REPLICATED_PART,
    UNIQUE_PART,
    FileBuffers,
    new_shard_file,
    shard_file_with_table,
    shard_name,
    slot_view,
)
from ringmaster.workers.checkpoint.snapshots.store import (
    METADATA_NAME,
    SNAPSHOTS_KEPT,
    FileMadeWhenRead,
    SnapshotRef,
    SnapshotStore,
    snapshot_location,
)
from ringmaster.workers.checkpoint.snapshots.transport import FileGather, exchange
from ringmaster.workers.checkpoint.training_state import checkpoint_stager, step_state, training_state
from ringmaster.workers.data.stream import DataPosition
from ringmaster.workers.strategies.zero1 import local_optimizer
from ringmaster.workers.torch_internals import default_group_timeout, foreach_copy_


class LiveFile(FileMadeWhenRead):
    """A rank's REPLICATED_PART shard file of a snapshot whose items every rank holds live (PeerSnapshots'
    `live_state`): not copied at its step but made from the live tensors when read, valid while they still hold the
    snapshot's step (`owner.live_step`; the next optimizer step ends it). What the live tensors do not keep is taken
    at the step: the byte items (the progress, the optimizer's hyperparameters), the step's own tensors, and the
    module buffers the next forward may change."""

    owner: PeerSnapshots

    def __init__(
        self, owner: PeerSnapshots, step: int, file: FileLayout, table: dict[int, Any], tensors: dict[int, torch.Tensor]
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


class PeerSnapshots:
    """One group's snapshots: taken after every step, copied to `replicas` buddies. Collective to construct (it makes
    the snapshots' gloo group).

    With `live_state` (every rank holds the whole model and optimizer state, and the optimizer step runs no
    collective: ddp), nothing of that state is copied at a step: a rank's live state is its snapshot of the step it
    last completed. Before the optimizer step, `seal` sends every rank's own items of the coming step's snapshot (its
    RNG states, rank 0's metric points) to every rank; after it, `after_update` names the live state the rest of that
    snapshot. Whichever peer fails when, a survivor that completed the step holds the whole snapshot of its state,
    and one that did not still holds the one before; the driver's choice then takes the newest (a step no one redoes).
    A full DCP save (`take`) makes the layout after a change of structure, as without `live_state`."""

    def __init__(
        self,
        store: SnapshotStore,
        job_id: str,
        generation: int,
        replicas: int,
        ranks_per_node: tuple[int, ...] | None,
        device: torch.device,
        *,
        model_parts: list[nn.Module],
        optimizers: list[Optimizer],
        live_state: bool = False,
        report: Callable[[list[dict[str, int]]], None] | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        """`report`: given on rank 0, called once with every rank's host-memory cost (host_memory_cost) when the
        snapshots reach their steady state (SNAPSHOTS_KEPT of them held). `timeout`: how long the snapshots' own group
        waits on a peer (None: as long as the default group does); gloo does not always report a peer that died
        mid-transfer, and a new group would otherwise wait torch's default half hour."""
        self.live_state = live_state
        self.live_step: int | None = None  # live_state: the step the live state is the snapshot of, if any
        self._sealed: tuple[int, DefaultSavePlanner] | None = None  # live_state: the step sealed, its own values
        self._matched_since_update: SnapshotLayout | None = None  # live_state: the layout the last update left intact
        self._store, self._job_id, self._generation = store, job_id, generation
        self._model_parts, self._optimizers = model_parts, optimizers
        self._local_optimizers = [local_optimizer(optimizer) for optimizer in optimizers]  # this rank's part (zero1)
        self._report, self._snapshots_completed = report, 0
        self.sent_bytes = 0  # what this rank sent its buddies for the latest snapshot
        self.layouts_made = 0  # full DCP saves: the first snapshot's, and one per change of the state's structure
        self.group = dist.new_group(backend="gloo", timeout=timeout or default_group_timeout(device))
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        # Ranks are contiguous per node: a shift of the largest node's size lands on another node (when nodes are
        # of equal size); on one node, on the next rank.
        shift = max(ranks_per_node) if ranks_per_node and len(ranks_per_node) > 1 else 1
        self._node_of = (
            [node for node, size in enumerate(ranks_per_node) for _ in range(size)]
            if ranks_per_node
            else [0] * self._world_size
        )
        self._buddy_offsets = sorted({(copy * shift) % self._world_size for copy in range(1, replicas + 1)} - {0})
        self._stager = checkpoint_stager(device)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot")
        self._in_flight: Future[None] | None = None
        self._layout: SnapshotLayout | None = None
        self._buffers = FileBuffers()
        self._gather = FileGather(self.group)

    def structure_changed(self) -> bool:
        """Whether this rank's live state has left the structure of the group's layout (or there is none yet), as the
        optimizer step left it: this rank's vote on the next snapshot being a full save. Local; the previous
        snapshot finishes first (it may be the full save that makes the layout)."""
        self.wait()
        layout = self._layout
        if layout is not None and layout is self._matched_since_update:
            return False  # live_state: after_update found this structure, and no update has run since
        return (
            layout is None
            or not layout.reusable
            or layout.state_fingerprint != fingerprint_of_state(self._model_parts, self._local_optimizers)
        )

    def take(
        self, step: int, position: DataPosition, metrics: str | None = None, *, changed_anywhere: bool | None = None
    ) -> None:
        """Snapshot the state after `step` in the background (the previous snapshot finishes first). Collective.

        While the state keeps its structure on every rank (`changed_anywhere`: the group's vote of structure_changed,
        which the trainer carries in its own per-step all-reduce; None: one all-reduce here asks), a snapshot reuses
        the group's layout: each rank fills its shard file from the live state's views (the part the next forward may
        change now, the rest in the background) and no DCP planning runs. Else a full DCP save makes a new layout."""
        if changed_anywhere is None:
            vote = torch.tensor([int(self.structure_changed())])
            dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group)
            changed_anywhere = bool(vote.item())
        self.wait()
        ref = SnapshotRef(self._generation, step)
        if self.live_state and not changed_anywhere:
            raise RuntimeError(
                f"snapshot of step {step}: with live_state, only a change of structure takes a snapshot "
                "after the step (seal and after_update take the others)"
            )
        if changed_anywhere:
            own_values = DefaultSavePlanner()  # flattens the step's own values as DCP does the whole state
            own_values.set_up_planner(step_state(step, position, metrics))
            step_values_fingerprint = fingerprint_of_step_values(own_values.state_dict)
            state = training_state(step, position, self._model_parts, self._optimizers, metrics=metrics)
            storages = live_storages(self._model_parts, self._local_optimizers)
            hyperparameters = hyperparameter_sources(state["optimizer"], self._local_optimizers)
            staged = self._stager.stage(state)
            state_fingerprint = fingerprint_of_state(self._model_parts, self._local_optimizers)
            self._in_flight = self._executor.submit(
                self._write_new_layout,
                ref,
                staged,
                state,
                state_fingerprint,
                step_values_fingerprint,
                storages,
                hyperparameters,
            )
            return
        values, layout = self._step_values(step, position, metrics), self._agreed_layout
        location, contents = snapshot_location(self._job_id, ref), []
        for file in layout.files:
            content = self._file_of_step(file, values, self._buffers.allocator(location, file.name))
            file.copy_live(content, at_boundary=True)
            contents.append(content)
        self._in_flight = self._executor.submit(self._write_reusing, location, layout, contents)

    def seal(self, step: int, position: DataPosition, metrics: str | None = None, *, changed_anywhere: bool) -> None:
        """live_state, before the optimizer step that completes step `step` (collective): every rank's UNIQUE_PART file
        of snapshot `step` (its RNG states, rank 0's metric points) goes to every rank, in one all-gather; from here
        the live state is no longer the last snapshot's. After a change of structure (`changed_anywhere`: the group's
        vote of structure_changed before the step), nothing is gathered: a full save (`take`) follows the step."""
        self.wait()
        self._sealed, self._matched_since_update = None, None
        if not changed_anywhere:
            values, layout = self._step_values(step, position, metrics), self._agreed_layout
            own = layout.files[UNIQUE_PART]
            location = snapshot_location(self._job_id, SnapshotRef(self._generation, step))
            gathered = self._gather(self._file_of_step(own, values))
            for rank, content in enumerate(gathered):
                self._store.write(location, shard_name(rank, UNIQUE_PART), content)
            self._store.write(location, METADATA_NAME, layout.metadata)
            self._store.retain(self._job_id)
            self._sealed = (step, values)
            # The newest whole snapshot is the last step's (reported with what its seal sent), while the live state
            # is still its.
            self._count_written(
                snapshot_location(self._job_id, SnapshotRef(self._generation, self.live_step))
                if self.live_step is not None
                else location
            )
            self.sent_bytes = gathered[self._rank].numel() * (self._world_size - 1)
        self.live_step = None

    def after_update(self, step: int) -> None:
        """live_state, after the optimizer step that completed step `step` (local): the live state is the rest of
        the snapshot `seal` began, while its structure is the layout's (else this rank holds no whole snapshot of
        the step, and its vote makes the next one a full save)."""
        sealed, self._sealed = self._sealed, None
        if sealed is None or sealed[0] != step or self.structure_changed():
            return
        self._matched_since_update = layout = self._agreed_layout
        kept = layout.files[REPLICATED_PART]
        table, tensors = items_of_step(kept, sealed[1], self._local_optimizers)
        self._store.write(
            snapshot_location(self._job_id, SnapshotRef(self._generation, step)),
            kept.name,
            LiveFile(self, step, kept, table, tensors),
        )
        self.live_step = step

    @property
    def _agreed_layout(self) -> SnapshotLayout:
        """The group's layout, where this rank found the state's structure unchanged (or the group voted so): a rank
        without a layout finds a change (structure_changed), and _step_values raises without one."""
        return cast(SnapshotLayout, self._layout)

    def _step_values(self, step: int, position: DataPosition, metrics: str | None) -> DefaultSavePlanner:
        """The step's own values (progress, RNG states, metric points), flattened as DCP does the whole state; they
        must keep the layout's structure."""
        values = DefaultSavePlanner()
        values.set_up_planner(step_state(step, position, metrics))
        layout = self._layout
        if layout is None or layout.step_values_fingerprint != fingerprint_of_step_values(values.state_dict):
            # A rank without a layout votes for a full save, and a rank's own values keep their structure within a
            # group: a change the group did not vote on cannot be met with a full save on this rank alone.
            raise RuntimeError(
                f"snapshot of step {step}: this rank's progress, RNG or metric items changed structure "
                "without the group's vote"
            )
        return values

    def _file_of_step(
        self,
        file: FileLayout,
        values: DefaultSavePlanner,
        allocate: Callable[[int], torch.Tensor] = lambda size: torch.empty(size, dtype=torch.uint8),
    ) -> torch.Tensor:
        """Shard file `file` of a step with its byte items and the step's own tensors filled in (not yet the live
        state's)."""
        table, tensors = items_of_step(file, values, self._local_optimizers)
        content = new_shard_file(file.tensor_bytes, table, allocate)
        if tensors:
            views = file.slot_views(content)
            for key, tensor in tensors.items():
                views[key].copy_(tensor)
        return content

    def before_state_changes(self) -> None:
        """Before the optimizer changes the state, the previous step's snapshot must be whole in peers' memory (not
        only copied out): a failure then costs at most the one step in progress. Waiting only for the copy would let
        a step complete while the snapshot before it could still be lost, and a failure cost two."""
        self.wait()

    def wait(self) -> None:
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()

    def hold_copies_of_live(self) -> None:
        """live_state, once this group's training ended (a stop, a failure): its snapshots' live files become copies
        in host memory, independent of this group's model (SnapshotStore.hold_copies_of_live)."""
        self._store.hold_copies_of_live(self)

    def close(self) -> None:
        self.wait()
        self._executor.shutdown()
        self._stager.close()
        dist.destroy_process_group(self.group)

    def _write_new_layout(
        self,
        ref: SnapshotRef,
        staged: Any,
        live: dict[str, Any],
        state_fingerprint: list[Any],
        step_values_fingerprint: list[Any],
        storages: dict[int, bool],
        hyperparameters: dict[str, tuple[int, int, str]],
    ) -> None:
        state = staged.result() if isinstance(staged, Future) else staged
        location = snapshot_location(self._job_id, ref)
        writer = SnapshotWriter(
            self._store, location, self._node_of, copies=None if self.live_state else len(self._buddy_offsets) + 1
        )
        dcp.save(state, storage_writer=writer, process_group=self.group)
        metadata = [self._store.read(location, METADATA_NAME).numpy().tobytes() if self._rank == 0 else None]
        dist.broadcast_object_list(metadata, src=0, group=self.group)
        metadata_bytes = cast(bytes, metadata[0])  # every rank's, after the broadcast
        layout = make_layout(
            state_fingerprint, step_values_fingerprint, writer.files, metadata_bytes, live, storages, hyperparameters
        )
        if self.live_state and (layout.files[UNIQUE_PART].live or layout.files[UNIQUE_PART].hyperparameters):
            raise RuntimeError(
                "in-memory snapshots of live state: this rank alone holds part of the model or optimizer "
                "state, which only copies protect (the strategy's state is not replicated)"
            )
        self._layout = layout
        self.layouts_made += 1
        self._share(location, [self._store.read(location, name) for name, _ in writer.files], metadata_bytes)

    def _write_reusing(self, location: str, layout: SnapshotLayout, contents: list[torch.Tensor]) -> None:
        for file, content in zip(layout.files, contents, strict=True):
            file.copy_live(content, at_boundary=False)
        self._share(location, contents, layout.metadata)

    def _share(self, location: str, own: list[torch.Tensor], metadata: bytes) -> None:
        """Hold this rank's shard files `own` (UNIQUE_PART, REPLICATED_PART) and the metadata, and exchange UNIQUE_PART
        files with the buddies (what a REPLICATED_PART file holds, a rank on another node holds too)."""
        for part, content in enumerate(own):
            self._store.write(location, shard_name(self._rank, part), content)
        self._store.write(location, METADATA_NAME, metadata)
        copied = own[UNIQUE_PART]
        self.sent_bytes = copied.numel() * len(self._buddy_offsets)
        for shift in self._buddy_offsets:
            source = (self._rank - shift) % self._world_size
            name = shard_name(source, UNIQUE_PART)
            self._store.write(
                location,
                name,
                exchange(
                    copied,
                    (self._rank + shift) % self._world_size,
                    source,
                    self.group,
                    self._buffers.allocator(location, name),
                ),
            )
        self._store.retain(self._job_id)
        self._buffers.release({snapshot_location(self._job_id, ref) for ref in self._store.snapshots(self._job_id)})
        if not self.live_state:  # with live_state, the steady state's snapshots are the sealed ones (seal counts them)
            self._count_written(location)

    def _count_written(self, latest: str) -> None:
        """One more snapshot complete, the newest at `latest`; the SNAPSHOTS_KEPT-th gathers every rank's cost for
        `report` (collective: every rank writes the same snapshots)."""
        self._snapshots_completed += 1
        if self._snapshots_completed == SNAPSHOTS_KEPT:
            costs: list[Any] = [None] * self._world_size
            dist.all_gather_object(costs, self.host_memory_cost(latest), group=self.group)
            if self._report is not None:
                self._report(costs)

    def host_memory_cost(self, latest: str) -> dict[str, int]:
        """This rank's host memory for snapshots: every file it holds (its own and its buddies' shards, of each
        snapshot kept) and, at steady state, the buffers of one more snapshot (FileBuffers: the next one is written
        before the oldest is let go); per snapshot the size of its own files (`live_bytes_per_snapshot` of them made
        from the live state when read, not copied at the step: live_state), what of them it copied for peers and
        what it sent them, and how many of its snapshots so far were full DCP saves (the rest reused their layout)."""
        names, live = self._store.names(latest), self._store.live_names(latest)
        copies = [
            {
                name: size
                for name, size in self._store.names(location).items()
                if name not in self._store.live_names(location)
            }
            for location in [snapshot_location(self._job_id, ref) for ref in self._store.snapshots(self._job_id)]
        ]
        spare_buffers = 0 if self.live_state else sum(names.values())
        own = [shard_name(self._rank, part) for part in (UNIQUE_PART, REPLICATED_PART)]
        return {
            "rank": self._rank,
            "held_bytes": sum(sum(held.values()) for held in copies) + spare_buffers,
            "own_bytes_per_snapshot": sum(names.get(name, 0) for name in own),
            "live_bytes_per_snapshot": sum(live.get(name, 0) for name in own),
            "copied_bytes_per_snapshot": names.get(shard_name(self._rank, UNIQUE_PART), 0),
            "sent_bytes_per_snapshot": self.sent_bytes,
            "full_saves": self.layouts_made,
        }
