"""Checkpoints: a resumed run continues bit-for-bit, interrupted saves are invisible, retention keeps the newest."""

from __future__ import annotations

import itertools
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ringmaster.workers.checkpoint.durable as checkpoint_module
from harness.checkpoints import latest_committed, load_model_weights, save_checkpoint, usable_checkpoints
from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec
from ringmaster.workers.checkpoint.durable import (
    MANIFEST_NAME,
    apply_retention,
    checkpoint_dir,
    committed_checkpoints,
    find_resume_point,
    load_checkpoint,
)
from ringmaster.workers.checkpoint.training_state import TrainingProgress
from ringmaster.workers.data.stream import DataPosition
from ringmaster.workers.models import build_bundle
from ringmaster.workers.trainer import TrainContext, run_training

STEPS = 6
STOP_AFTER = 3
SPEC = JobSpec(
    name="resume",
    model="tiny-gpt",
    model_options={"n_layers": 2, "dim": 32, "n_heads": 4, "seq_len": 32, "max_corpus_bytes": 16_384},
    workers={"min": 2, "max": 2},
    # 16 KiB ≈ 500 windows ≈ 16 steps per epoch: lr warmup and shuffling both matter across the resume.
    train={"steps": STEPS, "global_batch_size": 16, "micro_batch_size": 4, "warmup_steps": 4, "seed": 7},
    checkpoint={"every_steps": 2, "keep": 2},
)


def _uninterrupted_then_interrupted_and_resumed(rank: int, world_size: int, root: str) -> None:
    """Runs on each rank: one straight run; one stopped after STOP_AFTER steps, left a crashed save, then resumed."""
    runs: dict[str, list] = {"straight": [], "before_stop": [], "after_resume": [], "checkpoints": []}

    def context(storage: str, metrics: list, **callbacks) -> TrainContext:
        return TrainContext(
            rank,
            world_size,
            torch.device("cpu"),
            "resume",
            f"{root}/{storage}",
            sink=CallbackSink(on_metric=metrics.append, **callbacks),
        )

    run_training(SPEC, context("straight", runs["straight"]))
    calls = itertools.count(1)
    # The control plane stored the first two points (the driver confirms them) and not the third.
    stopped = run_training(
        SPEC,
        context(
            "resumed",
            runs["before_stop"],
            should_stop=lambda: next(calls) >= STOP_AFTER,
            metrics_confirmed=lambda: min(len(runs["before_stop"]), 2),
        ),
    )
    if rank == 0:
        crashed = Path(checkpoint_dir(f"{root}/resumed", STOP_AFTER + 2))
        crashed.mkdir()
        (crashed / "__0_0.distcp").write_bytes(b"half-written")
    dist.barrier()
    resumed = run_training(
        SPEC, context("resumed", runs["after_resume"], on_checkpoint=lambda record: runs["checkpoints"].append(record))
    )
    if rank == 0:
        # Points naming their attempt are the resumed checkpoint's, replayed; the rest the resumed run's own.
        replayed = [p.step for p in runs["after_resume"] if p.attempt is not None]
        runs["after_resume"] = [p for p in runs["after_resume"] if p.attempt is None]
        losses = {
            name: [p.loss for p in runs[name] if p.loss is not None]
            for name in ("straight", "before_stop", "after_resume")
        }
        first_resumed_step = next(p.step for p in runs["after_resume"])
        records = [record.model_dump(include={"step", "uri", "world_size", "final"}) for record in runs["checkpoints"]]
        summary = {
            "losses": losses,
            "stopped": [stopped.stopped, stopped.step],
            "first_resumed_step": first_resumed_step,
            "replayed": replayed,
        }
        summary.update(records=records, resumed_step=resumed.step, resumed_uri=resumed.checkpoint_uri)
        Path(f"{root}/summary.json").write_text(json.dumps(summary))


def test_resume_reproduces_uninterrupted_run_and_ignores_uncommitted_directory(tmp_path: Path) -> None:
    run_on_ranks(_uninterrupted_then_interrupted_and_resumed, 2, str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    losses = summary["losses"]

    assert summary["stopped"] == [True, STOP_AFTER]
    assert summary["first_resumed_step"] == STOP_AFTER + 1, (
        "resume must start after the stop checkpoint, not the crashed step 5"
    )
    assert summary["replayed"] == [STOP_AFTER], "the stop checkpoint kept the one point not yet stored"
    assert len(losses["straight"]) == STEPS
    assert losses["before_stop"] + losses["after_resume"] == losses["straight"]
    assert summary["records"] == [
        {"step": 4, "uri": checkpoint_dir(tmp_path / "resumed", 4), "world_size": 2, "final": False},
        {"step": 6, "uri": checkpoint_dir(tmp_path / "resumed", 6), "world_size": 2, "final": True},
    ]
    assert summary["resumed_uri"] == checkpoint_dir(tmp_path / "resumed", STEPS)

    straight, resumed = build_bundle(SPEC).model, build_bundle(SPEC).model
    load_model_weights(latest_committed(tmp_path / "straight").path, straight)
    load_model_weights(latest_committed(tmp_path / "resumed").path, resumed)
    for (name, expected), actual in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(actual, expected), name

    for storage in ("straight", "resumed"):
        assert sorted(p.name for p in (tmp_path / storage).iterdir()) == ["step-00000004", "step-00000006"]
        manifest = json.loads((Path(checkpoint_dir(tmp_path / storage, STEPS)) / MANIFEST_NAME).read_text())
        assert manifest["step"] == STEPS and manifest["world_size"] == 2
        assert manifest["strategy"] == "ddp" and manifest["spec_hash"] == SPEC.spec_hash()


def _commit(storage_root: Path, step: int) -> Path:
    path = Path(checkpoint_dir(storage_root, step))
    path.mkdir(parents=True)
    (path / MANIFEST_NAME).write_text(json.dumps({"step": step, "world_size": 1}))
    return path


def test_directory_without_valid_manifest_is_ignored(tmp_path: Path) -> None:
    _commit(tmp_path, 2)
    Path(checkpoint_dir(tmp_path, 3)).mkdir()
    (_commit(tmp_path, 4) / MANIFEST_NAME).write_text('{"step": 4, "world')
    (_commit(tmp_path, 5) / MANIFEST_NAME).write_text(json.dumps({"step": 9}))
    (tmp_path / "notes").mkdir()

    assert latest_committed(tmp_path).step == 2
    assert latest_committed(tmp_path / "absent") is None


def test_retention_keeps_newest_committed_and_drops_older_uncommitted(tmp_path: Path) -> None:
    for step in (1, 3, 5, 7):
        _commit(tmp_path, step)
    Path(checkpoint_dir(tmp_path, 6)).mkdir()
    Path(checkpoint_dir(tmp_path, 8)).mkdir()  # newer than every commit: may be a save in progress

    apply_retention(tmp_path, keep=2)

    assert [c.step for c in committed_checkpoints(tmp_path)] == [5, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005", "step-00000007", "step-00000008"]


def test_load_restores_rng_states_and_progress(tmp_path: Path, single_rank_group: None) -> None:
    spec = SPEC.model_copy(update={"workers": SPEC.workers.model_copy(update={"min": 1, "max": 1})})
    bundle = build_bundle(spec)
    optimizer = torch.optim.AdamW(bundle.model.parameters())
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    save_checkpoint(
        tmp_path, spec, step=9, position=DataPosition(2, 5), model_parts=[bundle.model], optimizers=[optimizer]
    )
    expected = (torch.rand(3), random.random(), np.random.rand())

    progress = load_checkpoint(checkpoint_dir(tmp_path, 9), model_parts=[bundle.model], optimizers=[optimizer])

    assert progress == TrainingProgress(9, DataPosition(2, 5))
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]


CORRUPT_STOP = 4


def _corrupt_newest_then_resume(rank: int, world_size: int, root: str) -> None:
    """Straight run; a run stopped at step 4 (checkpoints 2 and 4), its step-4 shard truncated, then resumed."""
    straight, before, after, events = [], [], [], []
    run_training(
        SPEC,
        TrainContext(
            rank, world_size, torch.device("cpu"), "c", f"{root}/straight", sink=CallbackSink(on_metric=straight.append)
        ),
    )
    calls = itertools.count(1)
    run_training(
        SPEC,
        TrainContext(
            rank,
            world_size,
            torch.device("cpu"),
            "c",
            f"{root}/corrupt",
            sink=CallbackSink(on_metric=before.append, should_stop=lambda: next(calls) >= CORRUPT_STOP),
        ),
    )
    shard = Path(checkpoint_dir(f"{root}/corrupt", CORRUPT_STOP)) / "__0_0.distcp"
    if rank == 0:
        shard.write_bytes(shard.read_bytes()[:100])
    dist.barrier()
    run_training(
        SPEC,
        TrainContext(
            rank,
            world_size,
            torch.device("cpu"),
            "c",
            f"{root}/corrupt",
            sink=CallbackSink(
                on_metric=after.append, on_event=lambda message, details: events.append([message, details])
            ),
        ),
    )
    if rank == 0:
        Path(f"{root}/summary.json").write_text(
            json.dumps(
                {
                    "straight": [p.loss for p in straight if p.loss is not None],
                    "before": [p.step for p in before if p.loss is not None],
                    "after": [[p.step, p.loss] for p in after if p.loss is not None and p.attempt is None],
                    "replayed": [p.step for p in after if p.attempt is not None],
                    "events": events,
                }
            )
        )


def test_corrupt_newest_checkpoint_is_skipped_with_an_event(tmp_path: Path) -> None:
    run_on_ranks(_corrupt_newest_then_resume, 2, str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())

    assert summary["before"] == list(range(1, CORRUPT_STOP + 1))
    resumed_steps = [step for step, _ in summary["after"]]
    assert resumed_steps == list(range(3, STEPS + 1)), "resume must use step 2, the newest checkpoint that verifies"
    assert [loss for _, loss in summary["after"]] == summary["straight"][2:]
    assert summary["replayed"] == [1, 2], "the points step 2's checkpoint kept, not those of the corrupt step 4"
    # Besides the checkpoint's: the composition's report of its layout (workers/strategies/decisions.py).
    checkpoint_events = [event for event in summary["events"] if "parallel_layout" not in event[1]]
    restored, corrupt = (
        [event for event in checkpoint_events if ("is corrupt" in event[0]) == flag] for flag in (False, True)
    )
    assert [details["restored_step"] for _, details in restored] == [2] and restored[0][1]["restore_s"] > 0
    [[message, details]] = corrupt
    assert message.startswith(
        f"checkpoint step {CORRUPT_STOP} is corrupt (step-00000004/__0_0.distcp: 100 bytes, manifest says "
    )
    assert message.endswith("); resumed from step 2")
    assert details["resumed_from_step"] == 2 and details["corrupt_checkpoints"][0]["step"] == CORRUPT_STOP


def test_manifest_lists_files_and_detects_changed_metadata(tmp_path: Path, single_rank_group: None) -> None:
    spec = SPEC.model_copy(update={"workers": SPEC.workers.model_copy(update={"min": 1, "max": 1})})
    bundle = build_bundle(spec)
    optimizer = torch.optim.AdamW(bundle.model.parameters())
    for step in (1, 2):
        save_checkpoint(
            tmp_path, spec, step=step, position=DataPosition(), model_parts=[bundle.model], optimizers=[optimizer]
        )
    manifest = json.loads((Path(checkpoint_dir(tmp_path, 2)) / MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp"} and all(
        size > 0 for size in manifest["files"].values()
    )
    assert [c.step for c in usable_checkpoints(tmp_path)] == [2, 1]

    metadata = Path(checkpoint_dir(tmp_path, 2)) / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    metadata.write_bytes(bytes(data))

    assert [c.step for c in usable_checkpoints(tmp_path)] == [1]
    assert latest_committed(tmp_path).step == 1
    newest, skipped = find_resume_point(tmp_path)
    assert newest.step == 1 and [(c.step, problem) for c, problem in skipped] == [
        (2, "step-00000002/.metadata: sha256 differs from the manifest's")
    ]


class _HeldWriter(dcp.FileSystemWriter):
    """Writes nothing until ``release`` exists (or 60 s pass): a save that takes as long as the test wants."""

    def __init__(self, path: Path, release: Path) -> None:
        super().__init__(path)
        self.release = release

    def write_data(self, plan, planner):
        deadline = time.monotonic() + 60
        while not self.release.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return super().write_data(plan, planner)


def _train_while_save_is_held(rank: int, world_size: int, root: str) -> None:
    """Every rank's step-2 save is held until rank 0 has seen step 4's metric: training must go on meanwhile."""
    release = Path(root, "release")
    storage = Path(root, "held")
    checkpoint_module._storage_writer = lambda path: (
        _HeldWriter(path, release) if path.endswith("step-00000002") else dcp.FileSystemWriter(path)
    )
    log: list[list] = []

    def on_metric(point) -> None:
        if point.loss is None:
            return
        log.append(["metric", point.step, (Path(checkpoint_dir(storage, 2)) / MANIFEST_NAME).exists()])
        if point.step == 4:
            release.touch()

    run_training(
        SPEC,
        TrainContext(
            rank,
            world_size,
            torch.device("cpu"),
            "held",
            str(storage),
            sink=CallbackSink(
                on_metric=on_metric, on_checkpoint=lambda record: log.append(["checkpoint", record.step, record.final])
            ),
        ),
    )
    if rank == 0:
        Path(root, "log.json").write_text(json.dumps(log))


def test_async_save_does_not_block_training(tmp_path: Path) -> None:
    run_on_ranks(_train_while_save_is_held, 2, str(tmp_path))
    log = json.loads((tmp_path / "log.json").read_text())

    # Steps 3 and 4 ran while step 2's shards could not be written, and nothing was committed or
    # reported before the write finished; step 4's save waited for step 2's (one in flight at a time).
    assert log[:6] == [
        ["metric", 1, False],
        ["metric", 2, False],
        ["metric", 3, False],
        ["metric", 4, False],
        ["checkpoint", 2, False],
        ["metric", 5, True],
    ]
    # Step 4's save commits whenever its write completes (seen at a step boundary), before the final one.
    assert sorted(log[6:]) == [["checkpoint", 4, False], ["checkpoint", 6, True], ["metric", 6, True]]
    assert log[-1] == ["checkpoint", 6, True]
    assert [c.step for c in usable_checkpoints(tmp_path / "held")] == [6, 4]


def _background_saves_and_a_two_step_run(rank: int, world_size: int, root: str) -> None:
    """Runs on each rank: 6 steps with saves after steps 2 and 4 staged in the background (made slow) while training
    goes on, and a run of 2 steps whose final save is synchronous."""
    import ringmaster.workers.checkpoint.checkpointer as training

    make_stager = training.checkpoint_stager

    def slow_stager(device: torch.device):
        stager = make_stager(device)
        stage = stager._stage

        def stage_late(state_dict, **kwargs):
            time.sleep(1.0)  # a copy slower than the next step's forward and backward
            return stage(state_dict, **kwargs)

        stager._stage = stage_late
        return stager

    training.checkpoint_stager = slow_stager
    spec = SPEC.model_copy(update={"checkpoint": SPEC.checkpoint.model_copy(update={"keep": 3})})
    try:
        run_training(spec, TrainContext(rank, world_size, torch.device("cpu"), "staged", f"{root}/six"))
    finally:
        training.checkpoint_stager = make_stager
    two = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": 2})})
    run_training(two, TrainContext(rank, world_size, torch.device("cpu"), "staged", f"{root}/two"))


def test_a_background_staged_save_holds_the_state_of_its_step(tmp_path: Path) -> None:
    run_on_ranks(_background_saves_and_a_two_step_run, 2, str(tmp_path))
    assert [c.step for c in usable_checkpoints(tmp_path / "six")] == [6, 4, 2]
    staged, synchronous = build_bundle(SPEC).model, build_bundle(SPEC).model
    load_model_weights(checkpoint_dir(tmp_path / "six", 2), staged)
    load_model_weights(checkpoint_dir(tmp_path / "two", 2), synchronous)
    for (name, expected), actual in zip(synchronous.state_dict().items(), staged.state_dict().values()):
        assert torch.equal(actual, expected), f"{name}: the step-2 save holds state changed by a later step"


def test_a_resumed_optimizer_keeps_this_runs_hyperparameters_and_takes_the_saved_moments(
    tmp_path: Path, single_rank_group: None
) -> None:
    """A checkpoint saved with one weight decay for every parameter, resumed by a run whose spec keeps biases and
    norms out of weight decay (no_decay), trains with this run's groups, not the saved ones; the moments are
    restored."""
    spec = SPEC.model_copy(update={"workers": SPEC.workers.model_copy(update={"min": 1, "max": 1})})
    saved_model = build_bundle(spec).model
    saved = torch.optim.AdamW(saved_model.parameters(), weight_decay=0.3, betas=(0.8, 0.9))
    sum(parameter.square().sum() for parameter in saved_model.parameters()).backward()
    saved.step()
    save_checkpoint(tmp_path, spec, step=1, position=DataPosition(0, 2), model_parts=[saved_model], optimizers=[saved])

    model = build_bundle(spec).model
    decayed = [parameter for parameter in model.parameters() if parameter.ndim > 1]
    kept = [parameter for parameter in model.parameters() if parameter.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": kept, "weight_decay": 0.0}])
    load_checkpoint(checkpoint_dir(tmp_path, 1), model_parts=[model], optimizers=[optimizer])

    assert [(group["weight_decay"], group["betas"]) for group in optimizer.param_groups] == [
        (0.1, (0.9, 0.999)),
        (0.0, (0.9, 0.999)),
    ]
    saved_moments = [saved.state[parameter]["exp_avg"] for parameter in saved_model.parameters()]
    loaded_moments = {id(parameter): optimizer.state[parameter]["exp_avg"] for parameter in model.parameters()}
    ordered = [loaded_moments[id(parameter)] for parameter in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(saved_moments, ordered, strict=True))
