"""In-memory snapshots on three local gloo ranks (one per "node"): after a rank is lost, a group re-formed from the
survivors (smaller, or with an empty replacement) continues from the snapshot the others hold in memory, with no
storage read, and trains on as the uninterrupted run does; a shard lost with every copy of it is named. For sharded
state (FSDP zero3) and for replicated state (ddp, whose every item every rank holds live: its snapshot copies only each
rank's own values).

Losing a rank is dropping everything its process held (its own shard, its metadata, the copies it kept for a buddy).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec
from ringmaster.workers.checkpoint.snapshots.resume_choice import choose_snapshot
from ringmaster.workers.checkpoint.snapshots.store import SNAPSHOTS_KEPT, SnapshotRef, SnapshotStore
from ringmaster.workers.models import build_bundle
from ringmaster.workers.trainer import TrainContext, run_training
from tests.support.strategy_reference import strategy_spec

STEPS, STOP_AFTER, LOST_RANK = 8, 4, 2
# FSDP zero3: every rank holds a different third of every parameter and its optimizer state; ddp: every rank all of it.
STRATEGIES = {"fsdp": {"shard": "zero3"}, "ddp": {}}


def _spec(strategy: str) -> JobSpec:
    """Global batch 24: the same batches at 3 and 2 workers (4 per micro-step, 2 or 3 accumulation steps)."""
    document = strategy_spec(f"memory-{strategy}", strategy, 3, STEPS, 4, **STRATEGIES[strategy])
    document["train"]["global_batch_size"] = 24
    document["workers"]["min"] = 1
    return JobSpec.model_validate(document)


def _regroup(rank: int | None, world_size: int, rendezvous: str) -> None:
    """Form the next group, meeting in a file of its own: a port chosen free when the test began could be another
    process's by the time a group met on it (minutes later, on a busy machine), and the group then failed."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank is not None:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)


def _train(
    spec: JobSpec,
    job: str,
    root: str,
    store: SnapshotStore,
    generation: int,
    *,
    stop_after: int | None = None,
    resume: SnapshotRef | None = None,
) -> tuple[list[Any], list[dict[str, Any]]]:
    points, events = [], []
    calls = itertools.count(1)
    should_stop = (lambda: next(calls) >= stop_after) if stop_after else (lambda: False)
    world_size = dist.get_world_size()
    run_training(
        spec,
        TrainContext(
            dist.get_rank(),
            world_size,
            torch.device("cpu"),
            job,
            f"{root}/{job}",
            ranks_per_node=(1,) * world_size,
            generation=generation,
            snapshot_store=store,
            resume_snapshot=resume,
            sink=CallbackSink(
                on_metric=points.append,
                on_event=lambda message, details: events.append(details),
                should_stop=should_stop,
            ),
        ),
    )
    return [[p.step, p.loss] for p in points if p.loss is not None], events


def _chosen(store: SnapshotStore, job: str) -> dict[str, Any]:
    inventories: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(inventories, store.inventory(job))
    choice = choose_snapshot(inventories)
    return {"chosen": choice.chosen, "why_not": choice.why_not}


def _lose_a_rank_and_continue(rank: int, world_size: int, root: str) -> None:
    store = SnapshotStore()
    out: dict[str, Any] = {}
    group_file = (str(Path(root, f"group-{index}")) for index in itertools.count())
    for strategy in STRATEGIES:
        spec, runs = _spec(strategy), {}
        runs["straight"], straight_events = _train(spec, f"{strategy}-straight", root, store, 1)
        runs["snapshot-cost"] = [e["snapshot_host_memory"] for e in straight_events if "snapshot_host_memory" in e]
        for ending in ("shrink", "replace", "buddy-lost"):
            job = f"{strategy}-{ending}"
            runs[job], _ = _train(spec, job, root, store, 1, stop_after=STOP_AFTER)
            lost = {LOST_RANK, LOST_RANK - 1} if ending == "buddy-lost" else {LOST_RANK}
            if rank in lost:
                store.drop(job)
            # Shrink: the survivors alone, renumbered; else all three, the lost ones empty.
            survivors = (
                [r for r in range(world_size) if r not in lost] if ending == "shrink" else list(range(world_size))
            )
            _regroup(survivors.index(rank) if rank in survivors else None, len(survivors), next(group_file))
            if rank in survivors:
                choice = _chosen(store, job)
                runs[f"{job}-choice"] = choice
                if choice["chosen"] is not None:
                    runs[f"{job}-resumed"], events = _train(
                        spec, job, root, store, 2, resume=SnapshotRef(**choice["chosen"])
                    )
                    runs[f"{job}-restored"] = [e for e in events if "restored_step" in e]
            _regroup(rank, world_size, next(group_file))
        out[strategy] = runs
    if rank == 0:
        Path(root, "runs.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("memory")
    run_on_ranks(_lose_a_rank_and_continue, 3, str(root))
    return json.loads((root / "runs.json").read_text())


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("ending, tolerance", [("replace", 1e-6), ("shrink", 1e-4)])
def test_a_regrouped_run_continues_from_peers_memory_as_the_uninterrupted_one(
    runs: dict[str, Any], strategy: str, ending: str, tolerance: float
) -> None:
    job, straight = f"{strategy}-{ending}", runs[strategy]["straight"]
    assert runs[strategy][f"{job}-choice"] == {"chosen": {"generation": 1, "step": STOP_AFTER}, "why_not": None}
    [restored] = runs[strategy][f"{job}-restored"]
    assert (restored["source"], restored["restored_step"], restored["storage_reads"]) == ("memory", STOP_AFTER, 0)
    if strategy == "ddp" and ending == "shrink":
        # Every survivor held every rank's own values (begin_snapshot sends them to all) and the rest is its live state.
        assert restored["bytes_moved"] == 0
    else:
        # The lost rank's shard came from its buddy; with a replacement it moved again, to the new rank.
        assert restored["bytes_moved"] > 0
    # The metric points the control plane never confirmed (here: none was) come back with the snapshot, then the
    # steps trained after it.
    resumed = runs[strategy][f"{job}-resumed"]
    assert [step for step, _ in resumed] == list(range(1, STEPS + 1))
    assert [loss for _, loss in resumed[:STOP_AFTER]] == [loss for _, loss in straight[:STOP_AFTER]]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in straight], abs=tolerance)
    assert abs(straight[-1][1] - straight[STOP_AFTER][1]) > 1e-2  # matching is not trivial


def test_a_shard_lost_with_its_only_copy_is_named(runs: dict[str, Any]) -> None:
    choice = runs["fsdp"]["fsdp-buddy-lost-choice"]
    assert choice["chosen"] is None
    # Rank 1's copy lived on rank 2: both are gone.
    assert f"step {STOP_AFTER} lacks __1_0.distcp" in choice["why_not"]


def test_one_survivor_of_a_replicated_state_holds_the_whole_snapshot(runs: dict[str, Any]) -> None:
    """ddp, two ranks of three lost: the survivor's live state and every rank's own values, which it holds, are the
    whole snapshot; the two new ranks receive it and train on as the uninterrupted run does."""
    assert runs["ddp"]["ddp-buddy-lost-choice"] == {"chosen": {"generation": 1, "step": STOP_AFTER}, "why_not": None}
    [restored] = runs["ddp"]["ddp-buddy-lost-restored"]
    assert (restored["source"], restored["restored_step"], restored["storage_reads"]) == ("memory", STOP_AFTER, 0)
    assert restored["bytes_moved"] > 0
    straight, resumed = runs["ddp"]["straight"], runs["ddp"]["ddp-buddy-lost-resumed"]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in straight], abs=1e-6)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_each_ranks_host_memory_for_snapshots_is_reported_once(runs: dict[str, Any], strategy: str) -> None:
    [costs] = runs[strategy]["snapshot-cost"]
    assert [cost["rank"] for cost in costs] == [0, 1, 2]
    # The parameters and Adam's two moments, in fp32.
    state_bytes = 3 * 4 * sum(p.numel() for p in build_bundle(_spec(strategy)).model.parameters())
    for cost in costs:
        assert cost["full_saves"] == 1  # the later snapshots reused the first's layout
    if strategy == "fsdp":
        for cost in costs:
            buddy = costs[(cost["rank"] - 1) % 3]  # one replica, on the next rank round the ring
            assert cost["sent_bytes_per_snapshot"] == cost["copied_bytes_per_snapshot"]
            # Its own shards and its buddy's copied one, of each of the snapshots it keeps (and their metadata).
            assert cost["held_bytes"] >= SNAPSHOTS_KEPT * (
                cost["own_bytes_per_snapshot"] + buddy["copied_bytes_per_snapshot"]
            )
            assert cost["live_bytes_per_snapshot"] == 0
        # zero3's shards are on one rank each: nearly all of a rank's state goes to its buddy (what every rank holds
        # alike, as the step, stays home).
        assert all(cost["copied_bytes_per_snapshot"] > 0.9 * cost["own_bytes_per_snapshot"] for cost in costs)
    else:
        # ddp's state is on every rank alike: its snapshot is the live state, not a copy; only each rank's own
        # values (its RNG, rank 0's metric points) are copied, and sent to both other ranks.
        for cost in costs:
            assert cost["live_bytes_per_snapshot"] == pytest.approx(state_bytes, rel=0.02)
            assert cost["own_bytes_per_snapshot"] == cost["live_bytes_per_snapshot"] + cost["copied_bytes_per_snapshot"]
            assert cost["sent_bytes_per_snapshot"] == 2 * cost["copied_bytes_per_snapshot"]
            assert 0 < cost["copied_bytes_per_snapshot"] < 0.03 * state_bytes
        # Each rank holds every rank's own values and the metadata of the snapshots kept, alike, and less than one
        # copy of the state (keeping copies would take SNAPSHOTS_KEPT of them).
        own_values = sum(cost["copied_bytes_per_snapshot"] for cost in costs)
        assert len({cost["held_bytes"] for cost in costs}) == 1, costs
        assert SNAPSHOTS_KEPT * own_values < costs[0]["held_bytes"] < state_bytes
