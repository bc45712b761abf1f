"""A rank that dies while its buddy copy is on the wire: the survivors never hold a half-received shard file, and the
snapshot the driver then chooses is the last one every copy of which arrived whole (three local gloo ranks, each
taken for a node; the dying one starts sending its shard of the third snapshot and exits).

The shard is ~100 MB: gloo writes what the socket takes at once inside the send call, and a few MB would be gone
whole before the process exits. Gloo does not always report the broken connection to the receiver: its wait ends at
the snapshots' group timeout."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ringmaster.workers.checkpoint.snapshots.group_snapshots as group_snapshots
from harness.process_group import run_on_ranks
from ringmaster.workers.checkpoint.snapshots.peer_snapshots import PeerSnapshots
from ringmaster.workers.checkpoint.snapshots.resume_choice import choose_snapshot
from ringmaster.workers.checkpoint.snapshots.store import SnapshotRef, SnapshotStore, snapshot_location
from ringmaster.workers.data.stream import DataPosition

WORLD_SIZE, DYING = 3, 2
WIDTH = 2048  # two square layers and their AdamW state: ~100 MB of shard per rank
TIMEOUT = timedelta(seconds=15)  # a whole transfer here takes well under a second
JOB = "interrupted-copy"


def _die_mid_copy(
    payload: torch.Tensor, to: int, source: int, group: dist.ProcessGroup, allocate: object
) -> torch.Tensor:
    size_out, size_in = torch.tensor([payload.numel()], dtype=torch.int64), torch.empty(1, dtype=torch.int64)
    for request in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, size_out, to, group), dist.P2POp(dist.irecv, size_in, source, group)]
    ):
        request.wait()
    dist.isend(payload, to, group=group)  # the shard starts out, and the process dies with it in flight
    os._exit(0)


def _copy_interrupted(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(rank)
    store = SnapshotStore()
    # A module of each rank's own (a name no other rank's state has), so no copy of it is elsewhere: it goes to the
    # buddy, ~100 MB on the wire.
    model = nn.ModuleDict({f"rank{rank}": nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))})
    optimizer = torch.optim.AdamW(model.parameters())
    snapshots = PeerSnapshots(
        store,
        JOB,
        1,
        1,
        (1,) * world_size,
        torch.device("cpu"),
        model_parts=[model],
        optimizers=[optimizer],
        timeout=TIMEOUT,
    )

    def step(number: int) -> None:
        model[f"rank{rank}"](torch.ones(4, WIDTH)).sum().backward()
        snapshots.before_state_changes()
        optimizer.step()
        optimizer.zero_grad()
        snapshots.take(number, DataPosition(0, 4 * number))

    step(1)
    step(2)
    snapshots.wait()
    sent = {
        name: size
        for name, size in store.names(snapshot_location(JOB, SnapshotRef(1, 2))).items()
        if name == f"__{rank}_0.distcp"
    }
    Path(root, f"sent-{rank}.json").write_text(json.dumps(sent))
    if rank == DYING:
        group_snapshots.exchange = _die_mid_copy  # where the snapshots look it up
    try:
        step(3)
        snapshots.wait()
        outcome = "completed"
    except Exception as error:  # the copy from the dead rank broke off
        outcome = type(error).__name__
    held = {str(step): store.names(snapshot_location(JOB, SnapshotRef(1, step))) for step in (1, 2, 3)}
    Path(root, f"survivor-{rank}.json").write_text(
        json.dumps({"outcome": outcome, "held": held, "inventory": store.inventory(JOB)})
    )
    os._exit(0)  # the group has a dead member: leave without its teardown


def test_a_shard_half_copied_when_its_rank_died_is_never_held_or_chosen(tmp_path: Path) -> None:
    run_on_ranks(_copy_interrupted, WORLD_SIZE, str(tmp_path))
    survivors = {
        rank: json.loads((tmp_path / f"survivor-{rank}.json").read_text())
        for rank in range(WORLD_SIZE)
        if rank != DYING
    }
    assert not (tmp_path / f"survivor-{DYING}.json").exists()
    dying_file = f"__{DYING}_0.distcp"
    # Rank 0 was receiving the dying rank's shard: it failed, and kept nothing of it.
    assert survivors[0]["outcome"] != "completed"
    assert all(dying_file not in survivor["held"]["3"] for survivor in survivors.values()), survivors
    # The snapshot before is whole: the dying rank's copy on rank 0 is as long as what it sent.
    sent = json.loads((tmp_path / f"sent-{DYING}.json").read_text())
    assert survivors[0]["held"]["2"][dying_file] == sent[dying_file] > 1_000_000
    choice = choose_snapshot([survivor["inventory"] for survivor in survivors.values()])
    assert (choice.chosen, choice.why_not) == ({"generation": 1, "step": 2}, None)
