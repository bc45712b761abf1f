"""What a group's snapshots share, whichever kind (PeerSnapshots, LiveStateSnapshots): the snapshots' own gloo group,
the full DCP save that makes the group's layout, a rank's shard files held and its unique part exchanged with its
buddies, the group's vote on the state's structure, retention, and the host-memory cost reported once."""

from __future__ import annotations

from abc import abstractmethod
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
    shard_name,
)
from ringmaster.workers.checkpoint.snapshots.step_snapshots import StepSnapshots
from ringmaster.workers.checkpoint.snapshots.store import (
    METADATA_NAME,
    SNAPSHOTS_KEPT,
    SnapshotRef,
    SnapshotStore,
    snapshot_location,
)
from ringmaster.workers.checkpoint.snapshots.transport import exchange
from ringmaster.workers.checkpoint.training_state import checkpoint_stager, step_state, training_state
from ringmaster.workers.data.stream import DataPosition
from ringmaster.workers.strategies.zero1 import local_optimizer
from ringmaster.workers.torch_internals import default_group_timeout


class GroupSnapshots(StepSnapshots):
    """One group's snapshots, `replicas` buddies keeping a copy of what a rank alone holds. Collective to construct (it
    makes the snapshots' gloo group)."""

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
        report: Callable[[str, dict[str, Any]], None] | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        """`report`: given on rank 0 (the sink's `event`), told once, as an event, every rank's host-memory cost
        (host_memory_cost) when the snapshots reach their steady state (SNAPSHOTS_KEPT of them held). `timeout`: how
        long the snapshots' own group waits on a peer (None: as long as the default group does); gloo does not always
        report a peer that died mid-transfer, and a new group would otherwise wait torch's default half hour."""
        self._store, self._job_id, self._generation = store, job_id, generation
        self._model_parts, self._optimizers = model_parts, optimizers
        self._local_optimizers = [local_optimizer(optimizer) for optimizer in optimizers]  # this rank's part (zero1)
        self._report, self._snapshots_completed = report, 0
        self._changed_anywhere = (
            True  # the group's last vote on the state's structure (the first snapshot is a full save)
        )
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

    def structure_changed(self) -> bool:
        """Whether this rank's live state has left the structure of the group's layout (or there is none yet), as the
        optimizer step left it: this rank's vote on the next snapshot being a full save. Local; the previous
        snapshot finishes first (it may be the full save that makes the layout)."""
        self.wait()
        layout = self._layout
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
        the group's layout (_take_with_layout). Else a full DCP save makes a new layout."""
        if changed_anywhere is None:
            vote = torch.tensor([int(self.structure_changed())])
            dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group)
            changed_anywhere = bool(vote.item())
        self.wait()
        ref = SnapshotRef(self._generation, step)
        if not changed_anywhere:
            self._take_with_layout(ref, position, metrics)
            return
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

    @abstractmethod
    def _take_with_layout(self, ref: SnapshotRef, position: DataPosition, metrics: str | None) -> None:
        """`take`, where the state kept the layout's structure on every rank."""

    def after_restore(self) -> None:
        pass  # a restore from the store's snapshots read them; the group's own replace them by retention

    def before_state_changes(self) -> None:
        """Before the optimizer changes the state, the previous step's snapshot must be whole in peers' memory (not
        only copied out): a failure then costs at most the one step in progress. Waiting only for the copy would let
        a step complete while the snapshot before it could still be lost, and a failure cost two."""
        self.wait()

    def wait(self) -> None:
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()

    def training_ended(self, *, stopped: bool) -> None:
        # The last snapshot (of a stop's step) is complete for the next group to use; after the last step none is.
        self.close()
        if not stopped:
            self._store.drop(self._job_id)

    def training_failed(self) -> None:
        pass  # the snapshots stay as the failure left them, for the driver to choose from

    def close(self) -> None:
        self.wait()
        self._executor.shutdown()
        self._stager.close()
        dist.destroy_process_group(self.group)

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

    @abstractmethod
    def _replicated_item_copies(self) -> int | None:
        """On how many nodes an item ranks on several nodes hold is kept (SnapshotWriter's `copies`)."""

    def _check_layout(self, layout: SnapshotLayout) -> None:
        """Raise where this kind of snapshots cannot protect the state a full save laid out."""

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
        writer = SnapshotWriter(self._store, location, self._node_of, copies=self._replicated_item_copies())
        dcp.save(state, storage_writer=writer, process_group=self.group)
        metadata = [self._store.read(location, METADATA_NAME).numpy().tobytes() if self._rank == 0 else None]
        dist.broadcast_object_list(metadata, src=0, group=self.group)
        metadata_bytes = cast(bytes, metadata[0])  # every rank's, after the broadcast
        layout = make_layout(
            state_fingerprint, step_values_fingerprint, writer.files, metadata_bytes, live, storages, hyperparameters
        )
        self._check_layout(layout)
        self._layout = layout
        self.layouts_made += 1
        self._share(location, [self._store.read(location, name) for name, _ in writer.files], metadata_bytes)

    def _share(self, location: str, own: list[torch.Tensor], metadata: bytes) -> None:
        """Hold this rank's shard files `own` (UNIQUE_PART, REPLICATED_PART) and the metadata, and exchange UNIQUE_PART
        files with the buddies (what a REPLICATED_PART file holds, a rank on another node holds too)."""
        for part, content in enumerate(own):
            self._store.write(location, shard_name(self._rank, part), content)
        self._store.write(location, METADATA_NAME, metadata)
        unique = own[UNIQUE_PART]
        self.sent_bytes = unique.numel() * len(self._buddy_offsets)
        for shift in self._buddy_offsets:
            source = (self._rank - shift) % self._world_size
            name = shard_name(source, UNIQUE_PART)
            self._store.write(
                location,
                name,
                exchange(
                    unique,
                    (self._rank + shift) % self._world_size,
                    source,
                    self.group,
                    self._buffers.allocator(location, name),
                ),
            )
        self._store.retain(self._job_id)
        self._buffers.release({snapshot_location(self._job_id, ref) for ref in self._store.snapshots(self._job_id)})
        self._shared(location)

    @abstractmethod
    def _shared(self, location: str) -> None:
        """A snapshot's files at `location` are held and exchanged with the buddies."""

    def _count_completed(self, latest: str) -> None:
        """One more snapshot complete, the newest at `latest`; the SNAPSHOTS_KEPT-th gathers every rank's cost for
        `report` (collective: every rank writes the same snapshots)."""
        self._snapshots_completed += 1
        if self._snapshots_completed == SNAPSHOTS_KEPT:
            costs: list[Any] = [None] * self._world_size
            dist.all_gather_object(costs, self.host_memory_cost(latest), group=self.group)
            if self._report is not None:
                most = max(costs, key=lambda cost: cost["held_bytes"])
                self._report(
                    f"in-memory snapshots hold up to {most['held_bytes']} bytes of host memory per rank "
                    f"(rank {most['rank']}); each snapshot sends {sum(c['sent_bytes_per_snapshot'] for c in costs)} "
                    "bytes to buddies in all",
                    {"snapshot_host_memory": costs},
                )

    def _spare_buffer_bytes(self, latest_files: dict[str, int]) -> int:
        """The host memory of the buffers held for the next snapshot, at steady state (FileBuffers: the next one is
        written before the oldest is let go): one more snapshot's own files (`latest_files`)."""
        return sum(latest_files.values())

    def host_memory_cost(self, latest: str) -> dict[str, int]:
        """This rank's host memory for snapshots: every file it holds (its own and its buddies' shards, of each
        snapshot kept) and the buffers held for the next one (_spare_buffer_bytes); per snapshot the size of its own
        files (`live_bytes_per_snapshot` of them made from the live state when read, not copied at the step:
        LiveStateSnapshots), what of them it copied for peers and what it sent them, and how many of its snapshots
        so far were full DCP saves (the rest reused their layout)."""
        names, live = self._store.names(latest), self._store.live_names(latest)
        copies = [
            {
                name: size
                for name, size in self._store.names(location).items()
                if name not in self._store.live_names(location)
            }
            for location in [snapshot_location(self._job_id, ref) for ref in self._store.snapshots(self._job_id)]
        ]
        own = [shard_name(self._rank, part) for part in (UNIQUE_PART, REPLICATED_PART)]
        return {
            "rank": self._rank,
            "held_bytes": sum(sum(held.values()) for held in copies) + self._spare_buffer_bytes(names),
            "own_bytes_per_snapshot": sum(names.get(name, 0) for name in own),
            "live_bytes_per_snapshot": sum(live.get(name, 0) for name in own),
            "copied_bytes_per_snapshot": names.get(shard_name(self._rank, UNIQUE_PART), 0),
            "sent_bytes_per_snapshot": self.sent_bytes,
            "full_saves": self.layouts_made,
        }
