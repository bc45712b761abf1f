"""Snapshot files are written into the memory of snapshots a rank has let go (shard_file.FileBuffers): the
snapshots it still holds keep exactly what they held when they were taken, while later steps reuse older buffers
(two local gloo ranks, each taken for a node, with state of its own that goes to the buddy and state both hold)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from harness.process_group import run_on_ranks
from ringmaster.workers.checkpoint.snapshots.peer_snapshots import PeerSnapshots
from ringmaster.workers.checkpoint.snapshots.store import SNAPSHOTS_KEPT, SnapshotRef, SnapshotStore, snapshot_location
from ringmaster.workers.data.stream import DataPosition

JOB, STEPS = "reused-buffers", 7


def _snapshot_steps(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(0)
    # "shared" is the same on both ranks (a replica, kept at home); "own" is this rank's alone (copied to the buddy).
    model = nn.ModuleDict({"shared": nn.Linear(64, 64), f"own{rank}": nn.Linear(64, 64)})
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    store = SnapshotStore()
    snapshots = PeerSnapshots(
        store, JOB, 1, 1, (1,) * world_size, torch.device("cpu"), model_parts=[model], optimizers=[optimizer]
    )
    taken: dict[int, dict[str, torch.Tensor]] = {}
    storages: dict[int, dict[str, int]] = {}
    for step in range(1, STEPS + 1):
        torch.manual_seed(step)  # the same input on both ranks: the replica stays one
        sum(layer(torch.randn(4, 64)).square().sum() for layer in model.values()).backward()
        snapshots.before_state_changes()
        optimizer.step()
        optimizer.zero_grad()
        snapshots.take(step, DataPosition(0, 4 * step))
        snapshots.wait()
        location = snapshot_location(JOB, SnapshotRef(1, step))
        files = {name: store.read(location, name) for name in store.names(location)}
        taken[step] = {name: content.clone() for name, content in files.items()}
        storages[step] = {name: content.untyped_storage().data_ptr() for name, content in files.items()}
    held = [ref.step for ref in store.snapshots(JOB)]
    unchanged = {
        step: all(
            torch.equal(store.read(snapshot_location(JOB, SnapshotRef(1, step)), name), content)
            for name, content in taken[step].items()
        )
        for step in held
    }
    # A shard file of the last step lies in memory an earlier step's file of the same name had.
    reused = [
        name
        for name, pointer in storages[STEPS].items()
        if name.endswith(".distcp") and any(storages[step].get(name) == pointer for step in range(1, STEPS))
    ]
    snapshots.close()
    Path(root, f"rank{rank}.json").write_text(
        json.dumps({"held": held, "unchanged": unchanged, "reused": reused, "files": sorted(taken[STEPS])})
    )


def test_held_snapshots_keep_their_content_while_later_ones_reuse_memory(tmp_path: Path) -> None:
    run_on_ranks(_snapshot_steps, 2, str(tmp_path))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["held"] == list(range(STEPS - SNAPSHOTS_KEPT + 1, STEPS + 1))
        assert result["unchanged"] == {str(step): True for step in result["held"]}
        buddy = 1 - rank
        # its own two files and the copy of its buddy's: every one written into memory a let-go snapshot had
        assert sorted(result["reused"]) == sorted([f"__{rank}_0.distcp", f"__{rank}_1.distcp", f"__{buddy}_0.distcp"])
        assert f"__{buddy}_0.distcp" in result["files"]
