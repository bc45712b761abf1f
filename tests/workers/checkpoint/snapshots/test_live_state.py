"""Snapshots of live state (ddp: every rank holds the whole model and optimizer state): when a failure leaves the
survivors one step apart, the group continues from the newer step, no step redone (three local gloo ranks, each
taken for a node, following the trainer's order: vote, begin_snapshot, optimizer step, complete_snapshot).

At step 4 every rank begins the snapshot (every rank's own items gathered by every rank); rank 0 completes the
optimizer step; rank 1 is left as a rank whose all-gather broke off when its peer died (its store without step 4's
files, its live state still step 3's); rank 2 dies. Between the gather and the end of the update, a rank's live state
is no snapshot at all: it holds none of it. Once a group's training ends, its live files become copies held in host
memory. A rank lost during the gather leaves the others nothing of the new step and their last step whole."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ringmaster.workers.checkpoint.snapshots.transport as transport
from harness.process_group import run_on_ranks
from ringmaster.workers.checkpoint.snapshots.live_state import LiveStateSnapshots
from ringmaster.workers.checkpoint.snapshots.restore import restore_from_peers
from ringmaster.workers.checkpoint.snapshots.resume_choice import choose_snapshot
from ringmaster.workers.checkpoint.snapshots.store import SnapshotRef, SnapshotStore, snapshot_location
from ringmaster.workers.data.stream import DataPosition

JOB, SPLIT_AT, DEAD = "live", 4, 2


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[float]]:
    tensors = list(model.parameters()) + [
        optimizer.state[p][name] for p in model.parameters() for name in ("exp_avg", "exp_avg_sq")
    ]
    return [tensor.flatten().tolist() for tensor in tensors]


def _begin(snapshots: LiveStateSnapshots, model: nn.Module, step: int, rank: int, world_size: int) -> bool:
    """A step up to its update, in the trainer's order: gradients averaged as DDP does, the group's vote on the
    state's structure, the step's snapshot begun. Returns the vote."""
    torch.manual_seed(100 * step + rank)  # each rank's own RNG stream: its state is the rank's own value
    model(torch.randn(4, 8)).square().sum().backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
        parameter.grad /= world_size
    vote = torch.tensor([float(snapshots.structure_changed())])
    dist.all_reduce(vote)
    changed = bool(vote.item())
    snapshots.begin_snapshot(step, DataPosition(0, 4 * step), changed_anywhere=changed)
    return changed


def _update(snapshots: LiveStateSnapshots, optimizer: torch.optim.Optimizer, step: int, changed: bool) -> None:
    optimizer.step()
    optimizer.zero_grad()
    snapshots.complete_snapshot(step)
    if changed:
        snapshots.take(step, DataPosition(0, 4 * step), changed_anywhere=True)


def _split_by_a_failure(rank: int, world_size: int, root: str, rendezvous: str) -> None:
    torch.manual_seed(0)
    model, optimizer = _model()
    store = SnapshotStore()
    snapshots = LiveStateSnapshots(
        store,
        JOB,
        1,
        1,
        (1,) * world_size,
        torch.device("cpu"),
        model_parts=[model],
        optimizers=[optimizer],
    )
    result: dict = {}

    for step in range(1, SPLIT_AT):
        _update(snapshots, optimizer, step, _begin(snapshots, model, step, rank, world_size))
    snapshots.wait()
    before = snapshot_location(JOB, SnapshotRef(1, SPLIT_AT - 1))
    result["held_before_gather"] = sorted(store.names(before))
    changed = _begin(snapshots, model, SPLIT_AT, rank, world_size)
    result["rng_at_split"] = torch.get_rng_state().tolist()
    result["held_after_gather"] = sorted(store.names(before))
    if rank == 0:
        _update(snapshots, optimizer, SPLIT_AT, changed)
        result["live_at_split"] = _state(model, optimizer)
    elif rank == 1:
        # The all-gather broke off here: nothing of step 4 arrived and the live state is still step 3's.
        store._files.pop(snapshot_location(JOB, SnapshotRef(1, SPLIT_AT)))
        snapshots.live_step = SPLIT_AT - 1
        result["live_before_restore"] = _state(model, optimizer)
    dist.destroy_process_group()
    # The group's training ended: its live files become copies, the model they were made from free to go.
    snapshots.hold_copies_of_live()
    for step in (SPLIT_AT - 1, SPLIT_AT):
        location = snapshot_location(JOB, SnapshotRef(1, step))
        result[f"held_{step}"], result[f"live_{step}"] = sorted(store.names(location)), store.live_names(location)
    if rank == DEAD:
        os._exit(0)  # its process, and everything it held, is gone
    # The survivors meet in a file: a port chosen free before the ranks started could be another process's by now.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    inventories: list = [None, None]
    dist.all_gather_object(inventories, store.inventory(JOB))
    choice = choose_snapshot(inventories)
    result["chosen"] = choice.chosen
    torch.manual_seed(7)  # a new group builds its model afresh
    restored_model, restored_optimizer = _model()
    progress, _, received = restore_from_peers(
        store,
        JOB,
        SnapshotRef(**choice.chosen),
        dist.group.WORLD,
        model_parts=[restored_model],
        optimizers=[restored_optimizer],
    )
    result.update(
        restored_step=progress.step,
        samples_in_epoch=progress.position.samples_in_epoch,
        received=received,
        restored=_state(restored_model, restored_optimizer),
        rng_restored=torch.get_rng_state().tolist(),
    )
    Path(root, f"rank{rank}.json").write_text(json.dumps(result))


def test_survivors_a_step_apart_continue_from_the_newer_step(tmp_path: Path) -> None:
    run_on_ranks(_split_by_a_failure, 3, str(tmp_path), str(tmp_path / "regrouped"))
    first, second = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    # Until the gather a rank's live state is its snapshot of step 3; from the gather on it holds no part of it.
    for result, rank in ((first, 0), (second, 1)):
        assert f"__{rank}_1.distcp" in result["held_before_gather"]
        assert f"__{rank}_1.distcp" not in result["held_after_gather"]
        assert {f"__{other}_0.distcp" for other in range(3)} <= set(result["held_after_gather"])
    # Once their group ended, each holds its live step's file as a copy; the older one's live file went.
    assert "__0_1.distcp" in first[f"held_{SPLIT_AT}"] and "__0_1.distcp" not in first[f"held_{SPLIT_AT - 1}"]
    assert "__1_1.distcp" in second[f"held_{SPLIT_AT - 1}"]
    assert all(not result[f"live_{step}"] for result in (first, second) for step in (SPLIT_AT - 1, SPLIT_AT))
    # Rank 0 alone holds step 4 whole (every rank's own values, its live state): the newer step is chosen.
    assert first["chosen"] == second["chosen"] == {"generation": 1, "step": SPLIT_AT}
    assert first["restored_step"] == second["restored_step"] == SPLIT_AT
    assert first["samples_in_epoch"] == second["samples_in_epoch"] == 4 * SPLIT_AT
    # Rank 1 rolled forward: it received rank 0's state of step 4 and holds it exactly; rank 0 needed nothing.
    assert first["received"] == 0 and second["received"] > 0
    assert second["live_before_restore"] != first["live_at_split"]
    assert first["restored"] == second["restored"] == first["live_at_split"]
    # Each rank's own RNG state of step 4 came back to it (rank 1's from rank 0, which the gather sent it).
    assert first["rng_restored"] == first["rng_at_split"]
    assert second["rng_restored"] == second["rng_at_split"]


def _die_in_the_gather(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(0)
    model, optimizer = _model()
    store = SnapshotStore()
    snapshots = LiveStateSnapshots(
        store,
        JOB,
        1,
        1,
        (1,) * world_size,
        torch.device("cpu"),
        model_parts=[model],
        optimizers=[optimizer],
        timeout=timedelta(seconds=15),
    )

    for step in range(1, SPLIT_AT):
        _update(snapshots, optimizer, step, _begin(snapshots, model, step, rank, world_size))
    snapshots.wait()
    if rank == DEAD:
        transport.FileGather.__call__ = lambda gather, content: os._exit(0)
    try:
        _update(snapshots, optimizer, SPLIT_AT, _begin(snapshots, model, SPLIT_AT, rank, world_size))
        outcome = "completed"
    except Exception as error:  # the all-gather broke off with its peer
        outcome = type(error).__name__
    held = {str(step): store.names(snapshot_location(JOB, SnapshotRef(1, step))) for step in (SPLIT_AT - 1, SPLIT_AT)}
    Path(root, f"survivor-{rank}.json").write_text(
        json.dumps(
            {"outcome": outcome, "held": held, "live_step": snapshots.live_step, "inventory": store.inventory(JOB)}
        )
    )
    os._exit(0)  # the group has a dead member: leave without its teardown


def test_a_rank_lost_in_the_gather_of_own_items_leaves_the_last_step_whole(tmp_path: Path) -> None:
    """A rank dies as the others gather step 4's own values: they hold nothing of step 4 and never update, and their
    live state is still step 3's whole snapshot, the one chosen."""
    run_on_ranks(_die_in_the_gather, 3, str(tmp_path))
    survivors = [json.loads((tmp_path / f"survivor-{rank}.json").read_text()) for rank in (0, 1)]
    assert not (tmp_path / f"survivor-{DEAD}.json").exists()
    for rank, survivor in enumerate(survivors):
        assert survivor["outcome"] != "completed"
        assert survivor["held"][str(SPLIT_AT)] == {}
        assert survivor["live_step"] == SPLIT_AT - 1
        assert f"__{rank}_1.distcp" in survivor["held"][str(SPLIT_AT - 1)]
    choice = choose_snapshot([survivor["inventory"] for survivor in survivors])
    assert (choice.chosen, choice.why_not) == ({"generation": 1, "step": SPLIT_AT - 1}, None)
