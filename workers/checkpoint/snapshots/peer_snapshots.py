"""Every step's state in host memory, the rank's own and copies on buddy ranks, so a re-formed group continues from
the step a failure interrupted without reading storage (JobSpec checkpoint.in_memory).

A snapshot is a DCP checkpoint held in the process's SnapshotStore, at ``{SNAPSHOT_ROOT}/{job}/g{generation:04d}-step-
{step:08d}``, in a storage layout of its own (SnapshotWriter: each item's raw bytes, where DCP's file writers serialise
every tensor with torch.save, most of a small model's snapshot time). Each rank holds there its own two shard files,
DCP's ``.metadata`` (rank 0 writes it; a broadcast gives every rank a copy) and the copied shard files of the ranks it
is a buddy of: ranks one node (`shift` ranks) further round the ring. A rank's ``__{rank}_0.distcp`` holds what no
rank on another node holds (its FSDP, pipeline or tensor shards, its RNG) and goes to its buddies, so a node's loss
leaves a copy of it on the next node; its ``__{rank}_1.distcp`` holds its share of the items ranks on other nodes
hold too (replicas: ddp's state, the replicated parts of zero1, hybrid and tensor parallel) and stays home. Each such
item is kept on as many nodes as a copied shard is (its replicas + 1), by one rank each, the bytes spread evenly: on
many nodes, a rank copies a fraction of the replicated state, not all of it. The metadata names each item's copies,
and a restore reads whichever is at hand. The process keeps the two newest snapshots it has: a peer that finished one
step fewer can still be met at the step before.

Taking a snapshot overlaps the next step. The first one of a group is a full DCP save (its planning collectives, the
state staged into host buffers in the background); it leaves a layout (_Layout): which items this rank writes, where
each lies in its file, and views of the live tensors they come from. While the state keeps that structure, the next
snapshots reuse it: no state dict, no planning, each rank copies the live tensors into a shard file (in the memory
of a snapshot it has let go) and sends it to its buddies, over a gloo group of the snapshots' own. Whether the state
kept its structure on every rank is a vote the trainer carries in its own per-step all-reduce (no collective of its
own per step). The optimizer step waits for the snapshot before it; one is in flight at a time, so at any moment
every member holds the snapshot of the last step or the one before: a failure costs at most one step.

Where every rank holds the whole model and optimizer state and the optimizer step runs no collective (ddp), nothing
of that state is copied (PeerSnapshots' `live_state`): a rank's live state is its snapshot of the step it last
completed, a file made only when read (_LiveFile). Before each optimizer step every rank's own items of the coming
step's snapshot (its RNG states, rank 0's metric points) go to every rank in one all-gather (`seal`); a rank that
completes the step then holds the whole snapshot of its new state, and one that a failure stopped before it still
holds the one before, so the group continues from the newer step and redoes none.

After a failure the driver asks every member of the new group what it holds (`SnapshotStore.inventory`) and names
the newest snapshot they cover between them (resume_choice.py); `restore_from_peers` then moves to
each rank, over the new group, the shard files its part of the state needs (DCP's own load planner says which), and
DCP loads and reshards them to the new world size. Durable checkpoints are untouched; they serve only when memory
cannot cover a snapshot.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import pickle
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.optim import Optimizer

from ringmaster.workers.checkpoint.training_state import (
    TrainingProgress,
    checkpoint_stager,
    load_state_template,
    load_training_state,
    step_state,
    training_state,
)
from ringmaster.workers.data.stream import DataPosition
from ringmaster.workers.strategies.parallel_model import local_tensor
from ringmaster.workers.strategies.zero1 import local_optimizer

SNAPSHOT_ROOT = "ringmaster-snapshots"  # a name in SnapshotStore, not a filesystem path
METADATA_NAME = ".metadata"
KEPT = 2  # the newest snapshot and the one before
_ALIGNMENT = 16  # every item starts at a multiple of this in its shard file, so it can be viewed as any dtype
_SNAPSHOT_DIR = re.compile(r"^g(\d{4})-step-(\d{8})$")


@dataclass(frozen=True)
class SnapshotRef:
    """Which snapshot: the group generation that took it, after which step."""

    generation: int
    step: int


def _job_root(job_id: str) -> str:
    return f"{SNAPSHOT_ROOT}/{job_id}"


def snapshot_location(job_id: str, ref: SnapshotRef) -> str:
    return f"{_job_root(job_id)}/g{ref.generation:04d}-step-{ref.step:08d}"


class SnapshotStore:
    """The snapshots in this process, across every group it joins (a worker actor keeps one for its life): per
    snapshot location, its files as byte tensors (a buddy's copy is kept as it was received, with no further copy)
    or as a _LiveFile, made from the live state when read, and held only while that state is still the snapshot's.
    The training thread's snapshot writer and the actor's inventory calls share it: a lock guards it."""

    def __init__(self) -> None:
        self._files: dict[str, dict[str, torch.Tensor | _LiveFile]] = {}
        self._lock = threading.Lock()

    def names(self, location: str) -> dict[str, int]:
        """File name -> size of what this process holds of one snapshot."""
        return {name: content.numel() for name, content in self._held(location).items()}

    def _held(self, location: str) -> dict[str, torch.Tensor | _LiveFile]:
        """The files of a snapshot held now: copies, and live files while they are valid."""
        with self._lock:
            files = dict(self._files.get(location, {}))
        return {
            name: content for name, content in files.items() if not isinstance(content, _LiveFile) or content.valid()
        }

    def hold_copies_of_live(self, owner: PeerSnapshots) -> None:
        """Make `owner`'s live files copies held here (those still valid; the rest go): its group's training ended,
        and the next group builds a model of its own, so the old one's memory (a GPU's above all) can be let go."""
        with self._lock:
            live = [
                (location, name, content)
                for location, files in self._files.items()
                for name, content in files.items()
                if isinstance(content, _LiveFile) and content.owner is owner
            ]
        for location, name, file in live:
            content = file.materialize() if file.valid() else None
            with self._lock:
                files = self._files.get(location, {})
                if files.get(name) is not file:
                    continue
                if content is not None and file.valid():
                    files[name] = content
                else:
                    del files[name]

    def live_names(self, location: str) -> dict[str, int]:
        """Of `names`, the files made from the live state when read (_LiveFile), not held as copies."""
        return {
            name: content.numel() for name, content in self._held(location).items() if isinstance(content, _LiveFile)
        }

    def read(self, location: str, name: str) -> torch.Tensor:
        with self._lock:
            content = self._files.get(location, {}).get(name)
        if isinstance(content, _LiveFile):
            live, content = content, content.materialize()
            if not live.valid():  # the state moved on while it was copied (or before)
                content = None
        if content is None:
            raise FileNotFoundError(f"{location}/{name}")
        return content

    def read_object(self, location: str, name: str) -> Any:
        return pickle.loads(self.read(location, name).numpy().data)

    def write(self, location: str, name: str, content: torch.Tensor | _LiveFile | bytes) -> None:
        tensor = _to_tensor(content) if isinstance(content, bytes) else content
        with self._lock:
            self._files.setdefault(location, {})[name] = tensor

    def snapshots(self, job_id: str) -> list[SnapshotRef]:
        """The snapshots this process holds any file of, oldest first."""
        prefix = f"{_job_root(job_id)}/"
        with self._lock:
            locations = [location for location, files in self._files.items() if files and location.startswith(prefix)]
        found = []
        for location in locations:
            match = _SNAPSHOT_DIR.match(location[len(prefix) :])
            if match:
                found.append(SnapshotRef(int(match.group(1)), int(match.group(2))))
        return sorted(found, key=lambda ref: (ref.generation, ref.step))

    def inventory(self, job_id: str) -> list[dict[str, Any]]:
        """What this process holds, for the driver's choice: per snapshot its files, and (where this process has the
        metadata) what the snapshot needs: groups of files, one of each group (an item's copies) at least."""
        held = []
        for ref in self.snapshots(job_id):
            location = snapshot_location(job_id, ref)
            names = self.names(location)
            required = None
            if METADATA_NAME in names:
                metadata = self.read_object(location, METADATA_NAME)
                required = [
                    list(files)
                    for files in sorted({slot.files() for slot in metadata.storage_data.values()} | {(METADATA_NAME,)})
                ]
            held.append({"generation": ref.generation, "step": ref.step, "files": sorted(names), "required": required})
        return held

    def retain(self, job_id: str, keep: int = KEPT) -> None:
        """Keep the newest `keep` snapshots this process has the metadata of, and any newer (one being taken)."""
        refs = self.snapshots(job_id)
        complete = [ref for ref in refs if METADATA_NAME in self.names(snapshot_location(job_id, ref))]
        if len(complete) <= keep:
            return
        oldest_kept = complete[-keep]
        with self._lock:
            for ref in refs:
                if (ref.generation, ref.step) < (oldest_kept.generation, oldest_kept.step):
                    self._files.pop(snapshot_location(job_id, ref), None)

    def drop(self, job_id: str) -> None:
        prefix = f"{_job_root(job_id)}/"
        with self._lock:
            for location in [location for location in self._files if location.startswith(prefix)]:
                del self._files[location]


@dataclass(frozen=True)
class RawSlot:
    """Where one item of a snapshot lies in a rank's shard file: a tensor's byte range, dtype and shape, or a byte
    item's (DCP's name for a non-tensor value) key in the file's table of pickled values."""

    relative_path: str
    offset: int = 0
    length: int = 0
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None
    key: int | None = None
    copies: tuple[RawSlot, ...] = ()  # the same item in other ranks' files (it is replicated across nodes)

    def files(self) -> tuple[str, ...]:
        """Every file that holds this item; any one of them will do."""
        return tuple(sorted({self.relative_path, *(copy.relative_path for copy in self.copies)}))


COPIED, KEPT_HERE = 0, 1  # a rank's two shard files: the one its buddies hold a copy of, and the one they need not


def _shard_name(rank: int, part: int = COPIED) -> str:
    return f"__{rank}_{part}.distcp"


@dataclass(frozen=True)
class _RankFiles:
    """What one rank writes of a snapshot (the coordinator decides, SnapshotWriter.prepare_global_plan): into its
    COPIED file the items DCP assigned it that no rank on another node holds; into its KEPT_HERE file its share of the
    items ranks on other nodes hold too (replicas: ddp's state, hybrid's and zero1's replicated parts). Each of those
    is kept by one rank on each of `copies` nodes (the buddy copies and the own one), so a node's loss leaves a copy
    of it without any buddy copy, and a group on many nodes does not copy its replicated state on every rank."""

    copied: list[MetadataIndex]
    kept: list[MetadataIndex]


def _item_bytes(item: WriteItem) -> int:
    """The bytes of the chunk `item` writes (WriteItem.tensor_storage_size counts the whole tensor it is a chunk of)."""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def _spread_replicas(
    holders: dict[MetadataIndex, list[int]], sizes: dict[MetadataIndex, int], node_of: list[int], copies: int
) -> dict[int, list[MetadataIndex]]:
    """Rank -> the replicated items it keeps: each item (held by `holders`, ranks on more than one node) by one
    holder on each of `copies` nodes (or every node that holds it, if fewer), the bytes spread evenly over the
    holders, largest items first."""
    load = dict.fromkeys(range(len(node_of)), 0)
    kept: dict[int, list[MetadataIndex]] = {rank: [] for rank in load}
    for index in sorted(holders, key=lambda index: -sizes[index]):
        least_loaded_per_node: dict[int, int] = {}
        for rank in holders[index]:
            node = node_of[rank]
            if node not in least_loaded_per_node or load[rank] < load[least_loaded_per_node[node]]:
                least_loaded_per_node[node] = rank
        for rank in sorted(least_loaded_per_node.values(), key=lambda rank: (load[rank], rank))[:copies]:
            kept[rank].append(index)
            load[rank] += sizes[index] + 1  # byte items count too, so they spread as well
    return kept


def _file_slots(items: list[WriteItem], tensors: dict[int, torch.Tensor], name: str) -> tuple[list[RawSlot], int]:
    """Where each of `items` lies in shard file `name`: the tensors among them (`tensors`, by item position) one after
    another, then a table of the byte items by position. Returns the slots and the tensors' length in bytes."""
    slots, offset = [], 0
    for key in range(len(items)):
        if key not in tensors:
            slots.append(RawSlot(name, key=key))
            continue
        tensor = tensors[key]
        length = tensor.numel() * tensor.element_size()
        slots.append(RawSlot(name, offset, length, tensor.dtype, tuple(tensor.shape)))
        offset += length + (-length % _ALIGNMENT)
    return slots, offset


def _new_file(
    tensor_bytes: int,
    values: dict[int, Any],
    allocate: Callable[[int], torch.Tensor] = lambda size: torch.empty(size, dtype=torch.uint8),
) -> torch.Tensor:
    """A shard file with room for `tensor_bytes` of tensors, then the pickled table of byte items and its length."""
    return _file_with_table(tensor_bytes, pickle.dumps(values), allocate)


def _file_with_table(
    tensor_bytes: int,
    table: bytes,
    allocate: Callable[[int], torch.Tensor] = lambda size: torch.empty(size, dtype=torch.uint8),
) -> torch.Tensor:
    content = allocate(tensor_bytes + len(table) + 8)
    content[tensor_bytes:].copy_(_to_tensor(table + len(table).to_bytes(8, "little")))
    return content


class _FileBuffers:
    """The memory of the snapshot files this rank no longer keeps, reused for the next ones: a fresh buffer of a
    model's size pays its page faults at every step, more than the copy into it costs. Files are views of a
    buffer with room to spare (the table of byte items varies a little in size between steps)."""

    SPARE = 64 * 1024

    def __init__(self) -> None:
        self._free: dict[str, list[torch.Tensor]] = {}
        self._used: dict[str, list[tuple[str, torch.Tensor]]] = {}  # location -> (file name, buffer)

    def allocator(self, location: str, name: str) -> Callable[[int], torch.Tensor]:
        def allocate(size: int) -> torch.Tensor:
            free = self._free.get(name, [])
            buffer = free.pop() if free else None
            if buffer is None or buffer.numel() < size:
                buffer = torch.empty(size + self.SPARE, dtype=torch.uint8)
            self._used.setdefault(location, []).append((name, buffer))
            return buffer[:size]

        return allocate

    def release(self, kept: set[str]) -> None:
        """Free the buffers of every snapshot location not in `kept` (the store no longer holds it)."""
        for location in [location for location in self._used if location not in kept]:
            for name, buffer in self._used.pop(location):
                self._free.setdefault(name, []).append(buffer)


def _slot_view(content: torch.Tensor, slot: RawSlot) -> torch.Tensor:
    # Only a tensor item's slot is viewed, and _file_slots gives it a dtype and a shape.
    dtype, shape = cast(torch.dtype, slot.dtype), cast(tuple[int, ...], slot.shape)
    return content[slot.offset : slot.offset + slot.length].view(dtype).view(shape)


def _resolved_tensor(planner: DefaultSavePlanner, item: WriteItem) -> torch.Tensor:
    """A tensor item's data, detached (resolve_data gives a tensor for every item but a byte item)."""
    return cast(torch.Tensor, planner.resolve_data(item)).detach()


def _shard_file(
    items: list[WriteItem], planner: DefaultSavePlanner, name: str
) -> tuple[torch.Tensor, list[WriteResult]]:
    """A rank's shard file: its tensors' raw bytes one after another, then one pickled table of its byte items (an
    optimizer hyperparameter, the progress, an RNG state: DCP's own resolve_data runs torch.save for each, and a
    model's optimizer has hundreds), then the table's length."""
    tensors = {
        key: _resolved_tensor(planner, item) for key, item in enumerate(items) if item.type != WriteItemType.BYTE_IO
    }
    slots, tensor_bytes = _file_slots(items, tensors, name)
    content = _new_file(
        tensor_bytes,
        {
            key: planner.lookup_object(item.index)
            for key, item in enumerate(items)
            if item.type == WriteItemType.BYTE_IO
        },
    )
    for key, tensor in tensors.items():
        _slot_view(content, slots[key]).copy_(tensor)
    return content, [
        WriteResult(index=item.index, size_in_bytes=slot.length, storage_data=slot)
        for item, slot in zip(items, slots, strict=True)
    ]


def _open_shard_file(content: torch.Tensor) -> tuple[torch.Tensor, dict[int, Any]]:
    size = int.from_bytes(content[-8:].numpy().tobytes(), "little")
    return content[: -8 - size], pickle.loads(content[-8 - size : -8].numpy().data)


class SnapshotWriter(StorageWriter):
    """DCP storage for a snapshot: each rank's two shard files (_RankFiles, each a _shard_file) in the process's
    store; the coordinator writes the metadata, naming for each item its slot and the replicas' slots. It keeps the
    items of each file this rank wrote, for the snapshots that reuse them (PeerSnapshots). `node_of`: each rank's
    node; `copies`: on how many nodes a replicated item is kept (the buddy copies and the own one); None: an item
    every rank holds is kept by every rank (its live state, PeerSnapshots' `live_state`), the rest is copied."""

    def __init__(self, store: SnapshotStore, location: str, node_of: list[int], copies: int | None) -> None:
        super().__init__()
        self._store, self._location, self._node_of, self._copies = store, location, node_of, copies
        self._local_items: list[WriteItem] = []
        self.files: list[tuple[str, list[WriteItem]]] = []

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Every item this rank holds, and its size, goes to the coordinator with the plan (DCP's dedup then keeps one
        # holder each).
        self._local_items = plan.items
        return dataclasses.replace(plan, storage_data={item.index: _item_bytes(item) for item in plan.items})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        holders: dict[MetadataIndex, list[int]] = {}
        sizes: dict[MetadataIndex, int] = {}
        for rank, plan in enumerate(plans):
            for index, size in plan.storage_data.items():
                holders.setdefault(index, []).append(rank)
                sizes[index] = size
        if self._copies is None:
            replicated = {index: ranks for index, ranks in holders.items() if len(ranks) == len(plans)}
            kept = {rank: [index for index, ranks in replicated.items() if rank in ranks] for rank in range(len(plans))}
        else:
            replicated = {
                index: ranks for index, ranks in holders.items() if len({self._node_of[rank] for rank in ranks}) > 1
            }
            kept = _spread_replicas(replicated, sizes, self._node_of, self._copies)
        return [
            dataclasses.replace(
                plan,
                storage_data=_RankFiles(
                    copied=[item.index for item in plan.items if item.index not in replicated], kept=kept[rank]
                ),
            )
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        # The snapshots' dcp.save takes DCP's default planner (it names none); _shard_file reads its byte items.
        default_planner = cast(DefaultSavePlanner, planner)
        rank, local = dist.get_rank(), {item.index: item for item in self._local_items}
        self.files = [
            (_shard_name(rank, COPIED), [local[index] for index in plan.storage_data.copied]),
            (_shard_name(rank, KEPT_HERE), [local[index] for index in plan.storage_data.kept]),
        ]
        results = []
        for name, items in self.files:
            content, written = _shard_file(items, default_planner, name)
            self._store.write(self._location, name, content)
            results += written
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        slots: dict[MetadataIndex, list[RawSlot]] = {}
        for rank_results in results:
            for result in rank_results:
                slots.setdefault(result.index, []).append(result.storage_data)
        metadata.storage_data = {
            index: dataclasses.replace(first, copies=tuple(rest)) for index, (first, *rest) in slots.items()
        }
        self._store.write(self._location, METADATA_NAME, pickle.dumps(metadata))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class SnapshotReader(StorageReader):
    """Reads what SnapshotWriter wrote, from the shard files this process holds (restore_from_peers fetched the
    rest), for DCP's default load planner."""

    def __init__(self, store: SnapshotStore, location: str) -> None:
        super().__init__()
        self._store, self._location = store, location
        self._slots: dict[Any, RawSlot] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata: Metadata = self._store.read_object(self._location, METADATA_NAME)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._slots = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        # load_training_state's dcp.load takes DCP's default planner (it names none); _load_value sets its state.
        default_planner = cast(DefaultLoadPlanner, planner)
        files: dict[str, tuple[torch.Tensor, dict[int, Any]]] = {}
        held = self._store.names(self._location)
        for item in plan.items:
            primary = self._slots[item.storage_index]
            slot = next((copy for copy in (primary, *primary.copies) if copy.relative_path in held), primary)
            if slot.relative_path not in files:
                files[slot.relative_path] = _open_shard_file(self._store.read(self._location, slot.relative_path))
            tensors, values = files[slot.relative_path]
            if item.type == LoadItemType.BYTE_IO:
                _load_value(default_planner, item, values[cast(int, slot.key)])  # a byte item's slot has a key
                continue
            stored = _slot_view(tensors, slot)
            target = planner.resolve_tensor(item).detach()
            target.copy_(narrow_tensor_by_index(stored, item.storage_offsets, item.lengths))
            planner.commit_tensor(item, target)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def _load_value(planner: DefaultLoadPlanner, read_item: ReadItem, value: Any) -> None:
    """Set a byte item's value where the planner's `load_bytes` would, as the snapshot holds it (a Python object):
    `load_bytes` takes it serialised, and a torch.save and a torch.load per item took a third of a small model's
    restore (a flattened optimizer state has an item per hyperparameter per parameter)."""
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], value)
    else:
        planner.state_dict[read_item.dest_index.fqn] = value


@dataclass(frozen=True)
class _FileLayout:
    """One of a rank's shard files while the state keeps its structure: its items and their slots, and where each
    item's value comes from at a step. `live`: views of the live parameters, module buffers and optimizer state
    (valid while the layout's fingerprint holds); `at_boundary`: the live items the next forward may change (module
    buffers), copied before it starts, the rest only the optimizer changes; `fresh`: items the step's own values
    give (progress, RNG states, metric points); `param_groups`: byte items that are an optimizer's hyperparameter
    (the learning rate changes every step), as (optimizer, group, name). `reusable`: every item has a source here."""

    name: str
    items: list[WriteItem]
    slots: list[RawSlot]
    tensor_bytes: int
    live: dict[int, torch.Tensor]
    at_boundary: frozenset[int]
    fresh: tuple[int, ...]
    param_groups: dict[int, tuple[int, int, str]]
    reusable: bool
    # Views of the slots in each file buffer this layout has filled, by the buffer's address: the buffers are reused
    # (_FileBuffers), and making a hundred views costs more than copying a small model's state into them. A cached
    # view keeps its buffer alive, so no other buffer can take its address; the oldest entry goes when a buffer
    # beyond the KEPT + 1 in use comes (one _FileBuffers replaced with a larger one).
    _views: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict, compare=False, repr=False)

    def slot_views(self, content: torch.Tensor) -> dict[int, torch.Tensor]:
        """Item position -> a view of its slot in file `content`, for every tensor item."""
        views = self._views.get(content.data_ptr())
        if views is None:
            views = {key: _slot_view(content, slot) for key, slot in enumerate(self.slots) if slot.key is None}
            if len(self._views) > KEPT:  # the buffers in use: KEPT snapshots' and the one being written
                del self._views[next(iter(self._views))]
            self._views[content.data_ptr()] = views
        return views

    def copy_live(self, content: torch.Tensor, *, at_boundary: bool) -> None:
        """Copy the live items that change at the boundary (module buffers), or the rest, into file `content`."""
        keys, sources = self.live_by_boundary[at_boundary]
        if keys:
            views = self.slot_views(content)
            torch._foreach_copy_([views[key] for key in keys], sources)

    @cached_property
    def live_by_boundary(self) -> dict[bool, tuple[list[int], list[torch.Tensor]]]:
        """Whether copied at the boundary -> those live items' positions and views (fixed for the layout)."""
        split: dict[bool, tuple[list[int], list[torch.Tensor]]] = {True: ([], []), False: ([], [])}
        for key, view in self.live.items():
            keys, sources = split[key in self.at_boundary]
            keys.append(key)
            sources.append(view)
        return split


@dataclass(frozen=True)
class _Layout:
    """What a group's snapshots share while the state keeps its structure: this rank's files, the snapshots'
    metadata, and the fingerprints of the live state (_state_fingerprint) and of the step's own values
    (_fresh_fingerprint) when the layout was made."""

    fingerprint: list[Any]
    fresh_fingerprint: list[Any]
    metadata: bytes
    files: tuple[_FileLayout, ...]

    @property
    def reusable(self) -> bool:
        return all(file.reusable for file in self.files)


class _LiveFile:
    """A rank's KEPT_HERE shard file of a snapshot whose items every rank holds live (PeerSnapshots' `live_state`):
    not copied at its step but made from the live tensors when read, valid while they still hold the snapshot's step
    (`owner.live_step`; the next optimizer step ends it). What the live tensors do not keep is taken at the step: the
    byte items (the progress, the optimizer's hyperparameters), the step's own tensors, and the module buffers the
    next forward may change."""

    def __init__(
        self, owner: PeerSnapshots, step: int, file: _FileLayout, table: dict[int, Any], fresh: dict[int, torch.Tensor]
    ) -> None:
        self.owner, self._step, self._file, self._fresh = owner, step, file, fresh
        self._table = pickle.dumps(table)
        self._buffers = [source.clone() for source in file.live_by_boundary[True][1]]

    def valid(self) -> bool:
        return self.owner.live_step == self._step

    def numel(self) -> int:
        """The size of the file it makes, as SnapshotStore.names reports a held file's."""
        return self._file.tensor_bytes + len(self._table) + 8

    def materialize(self) -> torch.Tensor:
        file = self._file
        content = _file_with_table(file.tensor_bytes, self._table)
        views = {key: _slot_view(content, slot) for key, slot in enumerate(file.slots) if slot.key is None}
        for key, tensor in self._fresh.items():
            views[key].copy_(tensor)
        for at_boundary, sources in ((True, self._buffers), (False, file.live_by_boundary[False][1])):
            keys = file.live_by_boundary[at_boundary][0]
            if keys:
                torch._foreach_copy_([views[key] for key in keys], sources)
        return content


def _state_fingerprint(model_parts: list[nn.Module], optimizers: list[Optimizer]) -> list[Any]:
    """The structure and storage of a rank's live parameters, buffers and optimizer state: equal at two steps when
    a snapshot's items come from the same places (it costs about a microsecond per tensor)."""
    entries: list[Any] = []
    for part in model_parts:
        for tensor in itertools.chain(part.parameters(), part.buffers()):
            local = local_tensor(tensor)
            entries.append((local.data_ptr(), local.shape, local.dtype))
    for local_optim in optimizers:
        for group in local_optim.param_groups:
            entries.append(
                [len(group["params"])]
                + [
                    (name, (value.data_ptr(), value.shape) if isinstance(value, torch.Tensor) else value)
                    for name, value in group.items()
                    if name not in ("params", "lr")
                ]
            )
            for parameter in group["params"]:
                for name, value in local_optim.state.get(parameter, {}).items():
                    if isinstance(value, torch.Tensor):
                        local = local_tensor(value)
                        entries.append((name, local.data_ptr(), local.shape, local.dtype))
                    else:
                        entries.append((name, value))
    return entries


def _fresh_fingerprint(fresh: dict[str, Any]) -> list[Any]:
    """The structure of the step's own values (flattened): fixed for a rank within a group (its RNG states, the
    progress, rank 0's metric points as one value)."""
    return [(key, value.shape, value.dtype) if isinstance(value, torch.Tensor) else key for key, value in fresh.items()]


def _live_storages(model_parts: list[nn.Module], optimizers: list[Optimizer]) -> dict[int, bool]:
    """The storage of every live parameter, module buffer and optimizer state tensor -> whether it is a buffer."""
    storages: dict[int, bool] = {}
    for part in model_parts:
        storages.update((local_tensor(tensor).untyped_storage().data_ptr(), False) for tensor in part.parameters())
        storages.update((local_tensor(tensor).untyped_storage().data_ptr(), True) for tensor in part.buffers())
    for local_optim in optimizers:
        for state in local_optim.state.values():
            storages.update(
                (local_tensor(value).untyped_storage().data_ptr(), False)
                for value in state.values()
                if isinstance(value, torch.Tensor)
            )
    return storages


def _param_group_sources(
    optimizer_state: dict[str, Any], optimizers: list[Optimizer]
) -> dict[str, tuple[int, int, str]]:
    """Flattened key of each hyperparameter in `optimizer_state` (training_state's flattened optimizer state, whose
    "state.{fqn}.{name}" values are the optimizers' own tensors) -> (optimizer, group, name) it is read from. A
    parameter with no state tensor has no entry."""
    owners: dict[int, tuple[int, int, str]] = {}
    for index, local_optim in enumerate(optimizers):
        for group_index, group in enumerate(local_optim.param_groups):
            for parameter in group["params"]:
                owners.update(
                    (id(value), (index, group_index, name))
                    for name, value in local_optim.state.get(parameter, {}).items()
                    if isinstance(value, torch.Tensor)
                )
    groups: dict[str, tuple[int, int]] = {}
    for key, value in optimizer_state.items():
        if key.startswith("state.") and id(value) in owners:
            index, group_index, name = owners[id(value)]
            groups[key[len("state.") : -len(name) - 1]] = (index, group_index)
    sources = {}
    for key in optimizer_state:
        if key.startswith("param_groups."):
            fqn, name = key[len("param_groups.") :].rsplit(".", 1)
            if fqn in groups:
                sources[f"optimizer.{key}"] = (*groups[fqn], name)
    return sources


def _file_layout(
    name: str,
    items: list[WriteItem],
    planner: DefaultSavePlanner,
    storages: dict[int, bool],
    param_group_sources: dict[str, tuple[int, int, str]],
) -> _FileLayout:
    tensors = {
        key: _resolved_tensor(planner, item) for key, item in enumerate(items) if item.type != WriteItemType.BYTE_IO
    }
    slots, tensor_bytes = _file_slots(items, tensors, name)
    live, at_boundary, fresh, param_groups, reusable = {}, set(), [], {}, True
    for key, item in enumerate(items):
        if item.index.fqn.split(".", 1)[0] not in ("model", "optimizer"):
            fresh.append(key)
        elif key in tensors:
            storage = tensors[key].untyped_storage().data_ptr()
            if tensors[key].numel() == 0:
                continue  # nothing to copy
            if storage not in storages:
                reusable = False  # a copy, not a view of the live state
                continue
            live[key] = tensors[key]
            if storages[storage]:
                at_boundary.add(key)
        elif item.index.fqn in param_group_sources:
            param_groups[key] = param_group_sources[item.index.fqn]
        else:
            reusable = False
    return _FileLayout(
        name, items, slots, tensor_bytes, live, frozenset(at_boundary), tuple(fresh), param_groups, reusable
    )


def _make_layout(
    fingerprint: list[Any],
    fresh_fingerprint: list[Any],
    files: list[tuple[str, list[WriteItem]]],
    metadata: bytes,
    live_state: dict[str, Any],
    storages: dict[int, bool],
    param_group_sources: dict[str, tuple[int, int, str]],
) -> _Layout:
    planner = DefaultSavePlanner()
    planner.set_up_planner(live_state)
    files_layout = tuple(_file_layout(name, items, planner, storages, param_group_sources) for name, items in files)
    return _Layout(fingerprint, fresh_fingerprint, metadata, files_layout)


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
        snapshots reach their steady state (KEPT of them held). `timeout`: how long the snapshots' own group waits on
        a peer (None: as long as the default group does); gloo does not always report a peer that died mid-transfer,
        and a new group would otherwise wait torch's default half hour."""
        self.live_state = live_state
        self.live_step: int | None = None  # live_state: the step the live state is the snapshot of, if any
        self._sealed: tuple[int, DefaultSavePlanner] | None = None  # live_state: the step sealed, its own values
        self._matched_since_update: _Layout | None = None  # live_state: the layout the last update left intact
        self._store, self._job_id, self._generation = store, job_id, generation
        self._model_parts, self._optimizers = model_parts, optimizers
        self._local_optimizers = [local_optimizer(optimizer) for optimizer in optimizers]  # this rank's part (zero1)
        self._report, self._written = report, 0
        self.sent_bytes = 0  # what this rank sent its buddies for the latest snapshot
        self.layouts_made = 0  # full DCP saves: the first snapshot's, and one per change of the state's structure
        self.group = dist.new_group(backend="gloo", timeout=timeout or _default_group_timeout(device))
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        # Ranks are contiguous per node: a shift of the largest node's size lands on another node (when nodes are
        # of equal size); on one node, on the next rank.
        shift = max(ranks_per_node) if ranks_per_node and len(ranks_per_node) > 1 else 1
        self._node_of = (
            [node for node, size in enumerate(ranks_per_node) for _ in range(size)]
            if ranks_per_node
            else [0] * self._world_size
        )
        self._shifts = sorted({(copy * shift) % self._world_size for copy in range(1, replicas + 1)} - {0})
        self._stager = checkpoint_stager(device)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot")
        self._in_flight: Future[None] | None = None
        self._layout: _Layout | None = None
        self._buffers = _FileBuffers()
        self._gather = _FileGather(self.group)

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
            or layout.fingerprint != _state_fingerprint(self._model_parts, self._local_optimizers)
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
            fresh_fingerprint = _fresh_fingerprint(own_values.state_dict)
            state = training_state(step, position, self._model_parts, self._optimizers, metrics=metrics)
            storages = _live_storages(self._model_parts, self._local_optimizers)
            sources = _param_group_sources(state["optimizer"], self._local_optimizers)
            staged = self._stager.stage(state)
            fingerprint = _state_fingerprint(self._model_parts, self._local_optimizers)
            self._in_flight = self._executor.submit(
                self._write_new_layout, ref, staged, state, fingerprint, fresh_fingerprint, storages, sources
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
        """live_state, before the optimizer step that completes step `step` (collective): every rank's COPIED file
        of snapshot `step` (its RNG states, rank 0's metric points) goes to every rank, in one all-gather; from here
        the live state is no longer the last snapshot's. After a change of structure (`changed_anywhere`: the group's
        vote of structure_changed before the step), nothing is gathered: a full save (`take`) follows the step."""
        self.wait()
        self._sealed, self._matched_since_update = None, None
        if not changed_anywhere:
            values, layout = self._step_values(step, position, metrics), self._agreed_layout
            own = layout.files[COPIED]
            location = snapshot_location(self._job_id, SnapshotRef(self._generation, step))
            gathered = self._gather(self._file_of_step(own, values))
            for rank, content in enumerate(gathered):
                self._store.write(location, _shard_name(rank, COPIED), content)
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
        kept = layout.files[KEPT_HERE]
        table, tensors = _items_of_step(kept, sealed[1], self._local_optimizers)
        self._store.write(
            snapshot_location(self._job_id, SnapshotRef(self._generation, step)),
            kept.name,
            _LiveFile(self, step, kept, table, tensors),
        )
        self.live_step = step

    @property
    def _agreed_layout(self) -> _Layout:
        """The group's layout, where this rank found the state's structure unchanged (or the group voted so): a rank
        without a layout finds a change (structure_changed), and _step_values raises without one."""
        return cast(_Layout, self._layout)

    def _step_values(self, step: int, position: DataPosition, metrics: str | None) -> DefaultSavePlanner:
        """The step's own values (progress, RNG states, metric points), flattened as DCP does the whole state; they
        must keep the layout's structure."""
        values = DefaultSavePlanner()
        values.set_up_planner(step_state(step, position, metrics))
        layout = self._layout
        if layout is None or layout.fresh_fingerprint != _fresh_fingerprint(values.state_dict):
            # A rank without a layout votes for a full save, and a rank's own values keep their structure within a
            # group: a change the group did not vote on cannot be met with a full save on this rank alone.
            raise RuntimeError(
                f"snapshot of step {step}: this rank's progress, RNG or metric items changed structure "
                "without the group's vote"
            )
        return values

    def _file_of_step(
        self,
        file: _FileLayout,
        values: DefaultSavePlanner,
        allocate: Callable[[int], torch.Tensor] = lambda size: torch.empty(size, dtype=torch.uint8),
    ) -> torch.Tensor:
        """Shard file `file` of a step with its byte items and the step's own tensors filled in (not yet the live
        state's)."""
        table, tensors = _items_of_step(file, values, self._local_optimizers)
        content = _new_file(file.tensor_bytes, table, allocate)
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
        live_state: dict[str, Any],
        fingerprint: list[Any],
        fresh_fingerprint: list[Any],
        storages: dict[int, bool],
        param_group_sources: dict[str, tuple[int, int, str]],
    ) -> None:
        state = staged.result() if isinstance(staged, Future) else staged
        location = snapshot_location(self._job_id, ref)
        writer = SnapshotWriter(
            self._store, location, self._node_of, copies=None if self.live_state else len(self._shifts) + 1
        )
        dcp.save(state, storage_writer=writer, process_group=self.group)
        metadata = [self._store.read(location, METADATA_NAME).numpy().tobytes() if self._rank == 0 else None]
        dist.broadcast_object_list(metadata, src=0, group=self.group)
        metadata_bytes = cast(bytes, metadata[0])  # every rank's, after the broadcast
        layout = _make_layout(
            fingerprint, fresh_fingerprint, writer.files, metadata_bytes, live_state, storages, param_group_sources
        )
        if self.live_state and (layout.files[COPIED].live or layout.files[COPIED].param_groups):
            raise RuntimeError(
                "in-memory snapshots of live state: this rank alone holds part of the model or optimizer "
                "state, which only copies protect (the strategy's state is not replicated)"
            )
        self._layout = layout
        self.layouts_made += 1
        self._share(location, [self._store.read(location, name) for name, _ in writer.files], metadata_bytes)

    def _write_reusing(self, location: str, layout: _Layout, contents: list[torch.Tensor]) -> None:
        for file, content in zip(layout.files, contents, strict=True):
            file.copy_live(content, at_boundary=False)
        self._share(location, contents, layout.metadata)

    def _share(self, location: str, own: list[torch.Tensor], metadata: bytes) -> None:
        """Hold this rank's shard files `own` (COPIED, KEPT_HERE) and the metadata, and exchange COPIED files with
        the buddies (what a KEPT_HERE file holds, a rank on another node holds too)."""
        for part, content in enumerate(own):
            self._store.write(location, _shard_name(self._rank, part), content)
        self._store.write(location, METADATA_NAME, metadata)
        copied = own[COPIED]
        self.sent_bytes = copied.numel() * len(self._shifts)
        for shift in self._shifts:
            source = (self._rank - shift) % self._world_size
            name = _shard_name(source, COPIED)
            self._store.write(
                location,
                name,
                _exchange(
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
        """One more snapshot complete, the newest at `latest`; the KEPT-th gathers every rank's cost for `report`
        (collective: every rank writes the same snapshots)."""
        self._written += 1
        if self._written == KEPT:
            costs: list[Any] = [None] * self._world_size
            dist.all_gather_object(costs, self.host_memory_cost(latest), group=self.group)
            if self._report is not None:
                self._report(costs)

    def host_memory_cost(self, latest: str) -> dict[str, int]:
        """This rank's host memory for snapshots: every file it holds (its own and its buddies' shards, of each
        snapshot kept) and, at steady state, the buffers of one more snapshot (_FileBuffers: the next one is written
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
        own = [_shard_name(self._rank, part) for part in (COPIED, KEPT_HERE)]
        return {
            "rank": self._rank,
            "held_bytes": sum(sum(held.values()) for held in copies) + spare_buffers,
            "own_bytes_per_snapshot": sum(names.get(name, 0) for name in own),
            "live_bytes_per_snapshot": sum(live.get(name, 0) for name in own),
            "copied_bytes_per_snapshot": names.get(_shard_name(self._rank, COPIED), 0),
            "sent_bytes_per_snapshot": self.sent_bytes,
            "full_saves": self.layouts_made,
        }


def _items_of_step(
    file: _FileLayout, values: DefaultSavePlanner, optimizers: list[Optimizer]
) -> tuple[dict[int, Any], dict[int, torch.Tensor]]:
    """What of shard file `file` a step gives besides the live tensors: its byte items (the step's own values and the
    optimizers' hyperparameters), by position, and the step's own tensors (RNG states), by position."""
    items = file.items
    table = {
        key: values.lookup_object(items[key].index) for key in file.fresh if items[key].type == WriteItemType.BYTE_IO
    }
    table.update(
        (key, optimizers[index].param_groups[group][name]) for key, (index, group, name) in file.param_groups.items()
    )
    tensors = {
        key: values.lookup_object(items[key].index) for key in file.fresh if items[key].type != WriteItemType.BYTE_IO
    }
    return table, tensors


class _FileGather:
    """Every rank's byte tensor (a shard file of a few KB, of a size that varies a little between steps), on every
    rank, in one all-gather: each sends its size and its content in a slot of a capacity the group agreed on. A
    content that does not fit is sent again, by every rank, in a slot grown to fit (with room to spare)."""

    HEADER, SPARE, ROUND = 8, 1.25, 4096

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group
        self._capacity = 0  # the same on every rank: it follows from what every rank gathered

    def __call__(self, content: torch.Tensor) -> list[torch.Tensor]:
        gathered = self._gather(content)
        sizes = [int.from_bytes(slot[: self.HEADER].numpy().tobytes(), "little") for slot in gathered]
        if max(sizes) > self._capacity:
            self._capacity = math.ceil(max(sizes) * self.SPARE / self.ROUND) * self.ROUND
            gathered = self._gather(content)
        return [slot[self.HEADER : self.HEADER + size] for slot, size in zip(gathered, sizes, strict=True)]

    def _gather(self, content: torch.Tensor) -> list[torch.Tensor]:
        slot = torch.zeros(self.HEADER + self._capacity, dtype=torch.uint8)
        slot[: self.HEADER] = _to_tensor(content.numel().to_bytes(self.HEADER, "little"))
        if content.numel() <= self._capacity:
            slot[self.HEADER : self.HEADER + content.numel()] = content
        gathered = [torch.empty_like(slot) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(gathered, slot, group=self._group)
        return gathered


def _default_group_timeout(device: torch.device) -> timedelta | None:
    """The default group's collective timeout (the worker sets it when the group forms); None where its backend does
    not say."""
    world = dist.group.WORLD
    if world is None:  # no default group
        return None
    try:
        timeout: timedelta = world._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout


def restore_from_peers(
    store: SnapshotStore,
    job_id: str,
    ref: SnapshotRef,
    group: dist.ProcessGroup,
    *,
    model_parts: list[nn.Module],
    optimizers: list[Optimizer],
) -> tuple[TrainingProgress, list[dict[str, Any]], int]:
    """Collective over the new group: fetch from peers the files of snapshot `ref` this rank needs, then load and
    reshard them. Returns the progress, the metric points the snapshot kept, and the bytes this rank received.
    The driver chose `ref` because the members hold every file of it between them."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    location = snapshot_location(job_id, ref)
    held: list[Any] = [None] * world_size
    dist.all_gather_object(held, sorted(store.names(location)), group=group)
    source = min(member for member, names in enumerate(held) if METADATA_NAME in names)
    broadcast = [store.read(location, METADATA_NAME).numpy().tobytes() if rank == source else None]
    dist.broadcast_object_list(broadcast, src=source, group=group)
    metadata_bytes = cast(bytes, broadcast[0])  # every rank's, after the broadcast
    if METADATA_NAME not in held[rank]:
        store.write(location, METADATA_NAME, metadata_bytes)
    metadata: Metadata = pickle.loads(metadata_bytes)
    state = load_state_template(metadata.state_dict_metadata, model_parts, optimizers)
    # Of an item's copies, one this rank holds; else the first some member holds (the reader takes what is here).
    everywhere = set().union(*held)
    fetch = {
        min(name for name in files if name in everywhere)
        for files in _files_needed(state, metadata)
        if not set(files) & set(held[rank])
    }
    wanted: list[Any] = [None] * world_size
    dist.all_gather_object(wanted, sorted(fetch), group=group)
    received = 0
    # One transfer at a time in an order every rank shares: each blocking send meets its receive.
    for name in sorted(set().union(*wanted)):
        holder = min(member for member, names in enumerate(held) if name in names)
        for destination, names in enumerate(wanted):
            if name not in names:
                continue
            if rank == holder:
                _send(store.read(location, name), destination, group)
            elif rank == destination:
                content = _receive(holder, group)
                store.write(location, name, content)
                received += content.numel()
    # The files were fetched above: each rank's reads are its own.
    progress, metrics = load_training_state(
        SnapshotReader(store, location), model_parts=model_parts, optimizers=optimizers, plan_locally=True, state=state
    )
    return progress, metrics, received


def _files_needed(state: dict[str, Any], metadata: Metadata) -> set[tuple[str, ...]]:
    """For each item DCP's load planner will read for this rank's `state`, the shard files that hold it."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    return {metadata.storage_data[item.storage_index].files() for item in planner.create_local_plan().items}


def _to_tensor(content: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(content), dtype=torch.uint8) if content else torch.empty(0, dtype=torch.uint8)


def _exchange(
    payload: torch.Tensor, to: int, source: int, group: dist.ProcessGroup, allocate: Callable[[int], torch.Tensor]
) -> torch.Tensor:
    """Send `payload` to rank `to` while receiving one from rank `source` (every rank does so at once: a ring), into
    memory from `allocate`."""
    size_out, size_in = torch.tensor([payload.numel()], dtype=torch.int64), torch.empty(1, dtype=torch.int64)
    for request in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, size_out, to, group), dist.P2POp(dist.irecv, size_in, source, group)]
    ):
        request.wait()
    received = allocate(int(size_in.item()))
    for request in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, payload, to, group), dist.P2POp(dist.irecv, received, source, group)]
    ):
        request.wait()
    return received


def _send(payload: torch.Tensor, destination: int, group: dist.ProcessGroup) -> None:
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), destination, group=group)
    if payload.numel():
        dist.send(payload, destination, group=group)


def _receive(source: int, group: dist.ProcessGroup) -> torch.Tensor:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, source, group=group)
    content = torch.empty(int(size.item()), dtype=torch.uint8)
    if content.numel():
        dist.recv(content, source, group=group)
    return content
