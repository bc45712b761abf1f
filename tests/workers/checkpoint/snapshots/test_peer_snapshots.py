"""Snapshots reuse their layout while the live state keeps its structure; when one rank's state alone leaves it, that
rank's vote (PeerSnapshots.structure_changed, carried by the trainer's own all-reduce) makes the whole group take a
full save, and the snapshots after it hold the new tensors' values (two local gloo ranks, each taken for a node)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from harness.process_group import run_on_ranks
from ringmaster.workers.checkpoint.snapshots.dcp_storage import SnapshotReader
from ringmaster.workers.checkpoint.snapshots.peer_snapshots import PeerSnapshots
from ringmaster.workers.checkpoint.snapshots.store import SnapshotRef, SnapshotStore, snapshot_location
from ringmaster.workers.data.stream import DataPosition

JOB, STEPS, MOVED_AT = "votes", 5, 3


def _snapshot_steps(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    store = SnapshotStore()
    snapshots = PeerSnapshots(
        store, JOB, 1, 1, (1,) * world_size, torch.device("cpu"), model_parts=[model], optimizers=[optimizer]
    )
    local_votes, agreed = [], []
    for step in range(1, STEPS + 1):
        torch.manual_seed(step)
        model(torch.randn(4, 8)).square().sum().backward()
        snapshots.before_state_changes()
        optimizer.step()
        optimizer.zero_grad()
        if step == MOVED_AT and rank == 1:
            # The optimizer's state moves to new memory on this rank only: the layout's views of it are stale.
            state = optimizer.state[model.weight]
            state["exp_avg"] = state["exp_avg"].clone()
        vote = snapshots.structure_changed()
        votes = torch.tensor([float(vote)])
        dist.all_reduce(votes)
        local_votes.append(vote)
        agreed.append(bool(votes.item()))
        snapshots.take(step, DataPosition(0, 4 * step), changed_anywhere=agreed[-1])
    snapshots.wait()
    location = snapshot_location(JOB, SnapshotRef(1, STEPS))
    reader = SnapshotReader(store, location)
    metadata = reader.read_metadata()
    live = optimizer.state[model.weight]["exp_avg"]
    key = next(fqn for fqn in metadata.state_dict_metadata if fqn.endswith("weight.exp_avg"))
    held = torch.empty_like(live)
    # One rank's files hold the whole replicated state: load it back through DCP to compare with the live tensor.
    dcp.load({key: held}, storage_reader=reader, process_group=snapshots.group)
    result = {
        "local_votes": local_votes,
        "agreed": agreed,
        "full_saves": snapshots.layouts_made,
        "snapshot_matches_live": torch.equal(held, live),
    }
    snapshots.close()
    Path(root, f"rank{rank}.json").write_text(json.dumps(result))


def test_one_ranks_change_of_structure_makes_the_whole_group_save_anew(tmp_path: Path) -> None:
    run_on_ranks(_snapshot_steps, 2, str(tmp_path))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # Step 1 has no layout yet (every rank votes); step 3 only rank 1's state moved.
        expected_local = [True, False, rank == 1, False, False]
        assert result["local_votes"] == expected_local
        assert result["agreed"] == [True, False, True, False, False]
        assert result["full_saves"] == 2
        assert result["snapshot_matches_live"]
