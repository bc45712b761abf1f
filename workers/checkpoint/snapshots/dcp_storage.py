"""DCP storage for a snapshot in the process's SnapshotStore: SnapshotWriter decides which rank writes which item
into which of its two shard files (a replicated item by one rank on each of a few nodes, the bytes spread evenly),
and SnapshotReader reads them back for DCP's default load planner from whichever copy is at hand."""

from __future__ import annotations

import dataclasses
import math
import pickle
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from ringmaster.workers.checkpoint.snapshots.shard_file import (
    REPLICATED_PART,
    UNIQUE_PART,
    RawSlot,
    build_shard_file,
    open_shard_file,
    shard_name,
    slot_view,
)
from ringmaster.workers.checkpoint.snapshots.store import METADATA_NAME, SnapshotStore
from ringmaster.workers.torch_internals import narrow_to_chunk, planner_set_value


@dataclass(frozen=True)
class _RankFiles:
    """What one rank writes of a snapshot (the coordinator decides, SnapshotWriter.prepare_global_plan): into its
    UNIQUE_PART file the items DCP assigned it that no rank on another node holds; into its REPLICATED_PART file its
    share of the items ranks on other nodes hold too (replicas: ddp's state, hybrid's and zero1's replicated parts).
    Each of those is kept by one rank on each of `copies` nodes (the buddy copies and the own one), so a node's loss
    leaves a copy of it without any buddy copy, and a group on many nodes does not copy its replicated state on every
    rank."""

    unique: list[MetadataIndex]
    replicated: list[MetadataIndex]


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


class SnapshotWriter(StorageWriter):
    """DCP storage for a snapshot: each rank's two shard files (_RankFiles, each a build_shard_file) in the process's
    store; the coordinator writes the metadata, naming for each item its slot and the replicas' slots. It keeps the
    items of each file this rank wrote, for the snapshots that reuse them (layout.py). `node_of`: each rank's
    node; `copies`: on how many nodes a replicated item is kept (the buddy copies and the own one); None: an item
    every rank holds is kept by every rank (its live state: LiveStateSnapshots), the rest is copied."""

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
                    unique=[item.index for item in plan.items if item.index not in replicated], replicated=kept[rank]
                ),
            )
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        # The snapshots' dcp.save takes DCP's default planner (it names none); build_shard_file reads its byte items.
        default_planner = cast(DefaultSavePlanner, planner)
        rank, local = dist.get_rank(), {item.index: item for item in self._local_items}
        self.files = [
            (shard_name(rank, UNIQUE_PART), [local[index] for index in plan.storage_data.unique]),
            (shard_name(rank, REPLICATED_PART), [local[index] for index in plan.storage_data.replicated]),
        ]
        results = []
        for name, items in self.files:
            content, written = build_shard_file(items, default_planner, name)
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
        # load_training_state's dcp.load takes DCP's default planner (it names none). A byte item's value is set where
        # the planner's `load_bytes` would, as the snapshot holds it (a Python object): `load_bytes` takes it
        # serialised, and a torch.save and a torch.load per item took a third of a small model's restore (a flattened
        # optimizer state has an item per hyperparameter per parameter).
        default_planner = cast(DefaultLoadPlanner, planner)
        files: dict[str, tuple[torch.Tensor, dict[int, Any]]] = {}
        held = self._store.names(self._location)
        for item in plan.items:
            primary = self._slots[item.storage_index]
            slot = next((copy for copy in (primary, *primary.copies) if copy.relative_path in held), primary)
            if slot.relative_path not in files:
                files[slot.relative_path] = open_shard_file(self._store.read(self._location, slot.relative_path))
            tensors, values = files[slot.relative_path]
            if item.type == LoadItemType.BYTE_IO:
                planner_set_value(default_planner, item.dest_index.fqn, values[cast(int, slot.key)])  # slot has a key
                continue
            stored = slot_view(tensors, slot)
            target = planner.resolve_tensor(item).detach()
            target.copy_(narrow_to_chunk(stored, item.storage_offsets, item.lengths))
            planner.commit_tensor(item, target)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False
