"""Every step's state in host memory, the rank's own and copies on buddy ranks, so a re-formed group continues from
the step a failure interrupted without reading storage (JobSpec checkpoint.in_memory).

A snapshot is a DCP checkpoint written into the process's in-memory filesystem (fsspec's ``memory://``), at
``{SNAPSHOT_ROOT}/{job}/g{generation:04d}-step-{step:08d}/``, in a storage layout of its own (SnapshotWriter: each
item's raw bytes, where DCP's file writers serialise every tensor with torch.save, most of a small model's snapshot
time). Each rank holds there its own shard file
(``__{rank}_0.distcp``), DCP's ``.metadata`` (rank 0 writes it; a broadcast gives every rank a copy) and the shard
files of the ranks it is a buddy of: ranks one node (`shift` ranks) further round the ring, so a node's loss leaves a
copy of each of its shards on the next node. The process keeps the two newest snapshots it has: a peer that finished
one step fewer can still be met at the step before.

Taking a snapshot overlaps the next step: the state is staged into host buffers in the background (the optimizer
step waits for that copy), then written, its metadata broadcast and the buddy copies exchanged, over a gloo group of
the snapshots' own. One snapshot is in flight at a time, and the next waits for it, so at any moment every member
holds the snapshot of the last step or the one before: a failure costs at most one step.

After a failure the driver asks every member of the new group what it holds (`SnapshotStore.inventory`) and names
the newest snapshot they cover between them (workers/driver/snapshot_choice.py); `restore_from_peers` then moves to
each rank, over the new group, the shard files its part of the state needs (DCP's own load planner says which), and
DCP loads and reshards them to the new world size. Durable checkpoints are untouched; they serve only when memory
cannot cover a snapshot.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.optim import Optimizer

from ringmaster.workers.checkpoint import (TrainingProgress, checkpoint_stager, load_state_template,
                                           load_training_state)

SNAPSHOT_ROOT = "memory://ringmaster-snapshots"
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
    """The snapshots in this process, across every group it joins (a worker actor keeps one for its life)."""

    def __init__(self) -> None:
        self.fs = fsspec.filesystem("memory")

    def names(self, location: str) -> dict[str, int]:
        """File name -> size of what this process holds of one snapshot."""
        if not self.fs.isdir(location):
            return {}
        return {entry["name"].rsplit("/", 1)[-1]: int(entry["size"])
                for entry in self.fs.ls(location, detail=True) if entry["type"] == "file"}

    def read(self, location: str, name: str) -> bytes:
        return self.fs.cat_file(f"{location}/{name}")

    def write(self, location: str, name: str, content: bytes) -> None:
        self.fs.makedirs(location, exist_ok=True)
        self.fs.pipe_file(f"{location}/{name}", content)

    def snapshots(self, job_id: str) -> list[SnapshotRef]:
        """The snapshots this process holds any file of, oldest first."""
        root = _job_root(job_id)
        if not self.fs.isdir(root):
            return []
        found = []
        for entry in self.fs.ls(root, detail=False):
            match = _SNAPSHOT_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if match:
                found.append(SnapshotRef(int(match.group(1)), int(match.group(2))))
        return sorted(found, key=lambda ref: (ref.generation, ref.step))

    def inventory(self, job_id: str) -> list[dict[str, Any]]:
        """What this process holds, for the driver's choice: per snapshot its files, and (where this process has the
        metadata) every file the snapshot consists of."""
        held = []
        for ref in self.snapshots(job_id):
            location = snapshot_location(job_id, ref)
            names = self.names(location)
            required = None
            if METADATA_NAME in names:
                metadata = pickle.loads(self.read(location, METADATA_NAME))
                required = sorted({info.relative_path for info in metadata.storage_data.values()} | {METADATA_NAME})
            held.append({"generation": ref.generation, "step": ref.step, "files": sorted(names), "required": required})
        return held

    def retain(self, job_id: str, keep: int = KEPT) -> None:
        """Keep the newest `keep` snapshots this process has the metadata of, and any newer (one being taken)."""
        refs = self.snapshots(job_id)
        complete = [ref for ref in refs if METADATA_NAME in self.names(snapshot_location(job_id, ref))]
        if len(complete) <= keep:
            return
        oldest_kept = complete[-keep]
        for ref in refs:
            if (ref.generation, ref.step) < (oldest_kept.generation, oldest_kept.step):
                self.fs.rm(snapshot_location(job_id, ref), recursive=True)

    def drop(self, job_id: str) -> None:
        root = _job_root(job_id)
        if self.fs.isdir(root):
            self.fs.rm(root, recursive=True)


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


def _shard_file(items: list[WriteItem], planner: DefaultSavePlanner, name: str) -> tuple[bytes, list[WriteResult]]:
    """A rank's shard file: its tensors' raw bytes one after another, then one pickled table of its byte items (an
    optimizer hyperparameter, the progress, an RNG state: DCP's own resolve_data runs torch.save for each, and a
    model's optimizer has hundreds), then the table's length."""
    pieces, results, values, offset = [], [], {}, 0
    for key, item in enumerate(items):
        if item.type == WriteItemType.BYTE_IO:
            values[key] = planner.lookup_object(item.index)
            results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=RawSlot(name, key=key)))
            continue
        tensor = planner.resolve_data(item).detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8)
        results.append(WriteResult(index=item.index, size_in_bytes=raw.numel(),
                                   storage_data=RawSlot(name, offset, raw.numel(), tensor.dtype, tuple(tensor.shape))))
        padding = -raw.numel() % _ALIGNMENT
        pieces += [raw, torch.zeros(padding, dtype=torch.uint8)] if padding else [raw]
        offset += raw.numel() + padding
    table = pickle.dumps(values)
    tensors = torch.cat(pieces).numpy().tobytes() if pieces else b""
    return tensors + table + len(table).to_bytes(8, "little"), results


def _open_shard_file(content: bytes) -> tuple[torch.Tensor, dict[int, Any]]:
    size = int.from_bytes(content[-8:], "little")
    return _to_tensor(content[:-8 - size]), pickle.loads(content[-8 - size:-8])


class SnapshotWriter(StorageWriter):
    """DCP storage for a snapshot: each rank's shard file (_shard_file) in the process's store; the coordinator
    writes the metadata. It keeps the rank's final plan, for the snapshots that reuse it (PeerSnapshots)."""

    def __init__(self, store: SnapshotStore, location: str) -> None:
        super().__init__()
        self._store, self._location = store, location
        self.final_plan: SavePlan | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=f"__{rank}_0.distcp") for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: DefaultSavePlanner) -> torch.futures.Future[list[WriteResult]]:
        self.final_plan = plan
        content, results = _shard_file(plan.items, planner, plan.storage_data)
        self._store.write(self._location, plan.storage_data, content)
        written: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        written.set_result(results)
        return written

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {result.index: result.storage_data for rank_results in results for result in rank_results}
        self._store.write(self._location, METADATA_NAME, pickle.dumps(metadata))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class SnapshotReader(StorageReader):
    """Reads what SnapshotWriter wrote, from the shard files this process holds (restore_from_peers fetched the
    rest)."""

    def __init__(self, store: SnapshotStore, location: str) -> None:
        super().__init__()
        self._store, self._location = store, location
        self._slots: dict[Any, RawSlot] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return pickle.loads(self._store.read(self._location, METADATA_NAME))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._slots = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        files: dict[str, tuple[torch.Tensor, dict[int, Any]]] = {}
        for item in plan.items:
            slot = self._slots[item.storage_index]
            if slot.relative_path not in files:
                files[slot.relative_path] = _open_shard_file(self._store.read(self._location, slot.relative_path))
            tensors, values = files[slot.relative_path]
            if item.type == LoadItemType.BYTE_IO:
                stream = io.BytesIO()  # the planner takes what torch.save writes
                torch.save(values[slot.key], stream)
                stream.seek(0)
                planner.load_bytes(item, stream)
                continue
            stored = tensors[slot.offset:slot.offset + slot.length].view(slot.dtype).view(slot.shape)
            target = planner.resolve_tensor(item).detach()
            target.copy_(narrow_tensor_by_index(stored, item.storage_offsets, item.lengths))
            planner.commit_tensor(item, target)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


@dataclass(frozen=True)
class _Layout:
    """What a group's snapshots share while the state keeps its structure: this rank's local plan (to see a change),
    its final plan (which items it writes, into which file) and the snapshots' metadata."""

    local_items: list[WriteItem]
    final_plan: SavePlan
    metadata: bytes


class PeerSnapshots:
    """One group's snapshots: taken after every step, copied to `replicas` buddies. Collective to construct (it makes
    the snapshots' gloo group)."""

    def __init__(self, store: SnapshotStore, job_id: str, generation: int, replicas: int,
                 ranks_per_node: tuple[int, ...] | None, device: torch.device,
                 report: Callable[[list[dict[str, int]]], None] | None = None) -> None:
        """`report`: given on rank 0, called once with every rank's host-memory cost (host_memory_cost) when the
        snapshots reach their steady state (KEPT of them held)."""
        self._store, self._job_id, self._generation = store, job_id, generation
        self._report, self._written = report, 0
        self.sent_bytes = 0  # what this rank sent its buddies for the latest snapshot
        self.group = dist.new_group(backend="gloo")
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        # Ranks are contiguous per node: a shift of the largest node's size lands on another node (when nodes are
        # of equal size); on one node, on the next rank.
        shift = max(ranks_per_node) if ranks_per_node and len(ranks_per_node) > 1 else 1
        self._shifts = sorted({(copy * shift) % self._world_size for copy in range(1, replicas + 1)} - {0})
        self._stager = checkpoint_stager(device)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot")
        self._in_flight: Future | None = None
        self._layout: _Layout | None = None

    def take(self, step: int, state: dict[str, Any]) -> None:
        """Snapshot `state`, the state after `step`, in the background (the previous snapshot finishes first)."""
        self.wait()
        staged = self._stager.stage(state)
        self._in_flight = self._executor.submit(self._write, SnapshotRef(self._generation, step), staged)

    def before_state_changes(self) -> None:
        """Before the optimizer changes the state, the previous step's snapshot must be whole in peers' memory (not
        only copied out): a failure then costs at most the one step in progress. Waiting only for the copy would let
        a step complete while the snapshot before it could still be lost, and a failure cost two."""
        self.wait()

    def wait(self) -> None:
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()

    def close(self) -> None:
        self.wait()
        self._executor.shutdown()
        self._stager.close()
        dist.destroy_process_group(self.group)

    def _write(self, ref: SnapshotRef, staged: Any) -> None:
        state = staged.result() if isinstance(staged, Future) else staged
        location = snapshot_location(self._job_id, ref)
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, storage_meta=None, is_coordinator=self._rank == 0)
        local_items = planner.create_local_plan().items
        # A step's state has the structure of the step before: DCP plans a snapshot (collectives over the group) and
        # makes its metadata once, and again only when some rank's local plan changes; the snapshots between reuse
        # them, each rank writing its shard file alone, at the byte offsets that metadata names.
        changed = torch.tensor([int(self._layout is None or self._layout.local_items != local_items)])
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.group)
        if changed.item():
            writer = SnapshotWriter(self._store, location)
            dcp.save(state, storage_writer=writer, process_group=self.group)
            metadata = [self._store.read(location, METADATA_NAME) if self._rank == 0 else None]
            dist.broadcast_object_list(metadata, src=0, group=self.group)
            assert writer.final_plan is not None
            self._layout = _Layout(local_items, writer.final_plan, metadata[0])
        else:
            assert self._layout is not None  # an unset layout is a change
            name = self._layout.final_plan.storage_data
            self._store.write(location, name, _shard_file(self._layout.final_plan.items, planner, name)[0])
        self._store.write(location, METADATA_NAME, self._layout.metadata)
        own_prefix = f"__{self._rank}_"
        own = {name: self._store.read(location, name) for name in self._store.names(location) if name.startswith(own_prefix)}
        payload = _to_tensor(pickle.dumps(own))
        self.sent_bytes = payload.numel() * len(self._shifts)
        for shift in self._shifts:
            received = _exchange(payload, (self._rank + shift) % self._world_size,
                                 (self._rank - shift) % self._world_size, self.group)
            for name, content in pickle.loads(received.numpy().tobytes()).items():
                self._store.write(location, name, content)
        self._store.retain(self._job_id)
        self._written += 1
        if self._written == KEPT:
            costs: list[Any] = [None] * self._world_size
            dist.all_gather_object(costs, self.host_memory_cost(location), group=self.group)
            if self._report is not None:
                self._report(costs)

    def host_memory_cost(self, latest: str) -> dict[str, int]:
        """This rank's host memory for snapshots: every file it holds (its own and its buddies' shards, of each
        snapshot kept), and per snapshot what it wrote itself and what it sent to buddies."""
        held = sum(sum(self._store.names(snapshot_location(self._job_id, ref)).values())
                   for ref in self._store.snapshots(self._job_id))
        own_prefix = f"__{self._rank}_"
        own = sum(size for name, size in self._store.names(latest).items() if name.startswith(own_prefix))
        return {"rank": self._rank, "held_bytes": held, "own_bytes_per_snapshot": own,
                "sent_bytes_per_snapshot": self.sent_bytes}


def restore_from_peers(store: SnapshotStore, job_id: str, ref: SnapshotRef, group: dist.ProcessGroup, *,
                       model_parts: list[nn.Module], optimizers: list[Optimizer]) -> tuple[TrainingProgress, list[dict[str, Any]], int]:
    """Collective over the new group: fetch from peers the files of snapshot `ref` this rank needs, then load and
    reshard them. Returns the progress, the metric points the snapshot kept, and the bytes this rank received.
    The driver chose `ref` because the members hold every file of it between them."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    location = snapshot_location(job_id, ref)
    held: list[Any] = [None] * world_size
    dist.all_gather_object(held, sorted(store.names(location)), group=group)
    source = min(member for member, names in enumerate(held) if METADATA_NAME in names)
    metadata_bytes = [store.read(location, METADATA_NAME) if rank == source else None]
    dist.broadcast_object_list(metadata_bytes, src=source, group=group)
    if METADATA_NAME not in held[rank]:
        store.write(location, METADATA_NAME, metadata_bytes[0])
    metadata: Metadata = pickle.loads(metadata_bytes[0])
    state = load_state_template(metadata.state_dict_metadata, model_parts, optimizers)
    needed = _files_needed(state, metadata)
    wanted: list[Any] = [None] * world_size
    dist.all_gather_object(wanted, sorted(needed - set(held[rank])), group=group)
    received = 0
    # One transfer at a time in an order every rank shares: each blocking send meets its receive.
    for name in sorted(set().union(*wanted)):
        holder = min(member for member, names in enumerate(held) if name in names)
        for destination, names in enumerate(wanted):
            if name not in names:
                continue
            if rank == holder:
                _send(_to_tensor(store.read(location, name)), destination, group)
            elif rank == destination:
                content = _receive(holder, group).numpy().tobytes()
                store.write(location, name, content)
                received += len(content)
    progress, metrics = load_training_state(SnapshotReader(store, location), model_parts=model_parts, optimizers=optimizers,
                                            process_group=group, state=state)
    return progress, metrics, received


def _files_needed(state: dict[str, Any], metadata: Metadata) -> set[str]:
    """The shard files DCP's load planner will read for this rank's `state`."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    return {metadata.storage_data[item.storage_index].relative_path for item in planner.create_local_plan().items}


def _to_tensor(content: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(content), dtype=torch.uint8) if content else torch.empty(0, dtype=torch.uint8)


def _exchange(payload: torch.Tensor, to: int, source: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Send `payload` to rank `to` while receiving one from rank `source` (every rank does so at once: a ring)."""
    size_out, size_in = torch.tensor([payload.numel()], dtype=torch.int64), torch.empty(1, dtype=torch.int64)
    for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, size_out, to, group),
                                           dist.P2POp(dist.irecv, size_in, source, group)]):
        request.wait()
    received = torch.empty(int(size_in.item()), dtype=torch.uint8)
    for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, payload, to, group),
                                           dist.P2POp(dist.irecv, received, source, group)]):
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

