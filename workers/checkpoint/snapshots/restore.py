"""A re-formed group's restore from its members' memory: each rank fetches from peers the shard files of the
chosen snapshot its part of the state needs (DCP's own load planner says which), and DCP loads and reshards them to
the new world size."""

from __future__ import annotations

import pickle
from typing import Any, cast

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.optim import Optimizer

from ringmaster.workers.checkpoint.snapshots.dcp_storage import SnapshotReader
from ringmaster.workers.checkpoint.snapshots.store import METADATA_NAME, SnapshotRef, SnapshotStore, snapshot_location
from ringmaster.workers.checkpoint.snapshots.transport import receive_file, send_file
from ringmaster.workers.checkpoint.training_state import TrainingProgress, load_state_template, load_training_state


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
                send_file(store.read(location, name), destination, group)
            elif rank == destination:
                content = receive_file(holder, group)
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
