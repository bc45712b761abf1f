"""JobSpec.resume_from: a new job starts from another job's newest usable checkpoint, also at another world
size and past a corrupt newest checkpoint (on Ray, with an event saying so); the id must exist."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import pytest
import torch

from harness.local_control_plane import wait_for_state
from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.service.client import RingmasterClient
from ringmaster.service.db import Database, session_scope
from ringmaster.service.errors import InvalidSpec
from ringmaster.service.jobs import submit_job
from ringmaster.service.spec import JobSpec
from ringmaster.workers.checkpoint.durable import committed_checkpoints
from ringmaster.workers.trainer import TrainContext, run_training
from tests.workers.checkpoint.test_durable import SPEC, STEPS

STOP_AFTER = 4


def _train_stop_then_continue_in_another_job(rank: int, world_size: int, root: str) -> None:
    straight, first, second = [], [], []
    run_training(
        SPEC,
        TrainContext(
            rank, world_size, torch.device("cpu"), "s", f"{root}/straight", sink=CallbackSink(on_metric=straight.append)
        ),
    )
    calls = itertools.count(1)
    run_training(
        SPEC,
        TrainContext(
            rank,
            world_size,
            torch.device("cpu"),
            "a",
            f"{root}/job-a",
            sink=CallbackSink(on_metric=first.append, should_stop=lambda: next(calls) >= STOP_AFTER),
        ),
    )
    spec_b = SPEC.model_copy(update={"resume_from": "job-a"})
    run_training(
        spec_b,
        TrainContext(
            rank,
            world_size,
            torch.device("cpu"),
            "b",
            f"{root}/job-b",
            sink=CallbackSink(on_metric=second.append),
            resume_from_root=f"{root}/job-a",
        ),
    )
    if rank == 0:
        Path(root, "summary.json").write_text(
            json.dumps(
                {
                    name: [[p.step, p.loss] for p in points if p.loss is not None]
                    for name, points in (("straight", straight), ("a", first), ("b", second))
                }
            )
        )


def test_new_job_continues_from_another_jobs_checkpoint(tmp_path: Path) -> None:
    run_on_ranks(_train_stop_then_continue_in_another_job, 2, str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())

    assert [step for step, _ in summary["b"]] == list(range(STOP_AFTER + 1, STEPS + 1))
    assert [loss for _, loss in summary["a"] + summary["b"]] == [loss for _, loss in summary["straight"]]
    assert [c.step for c in committed_checkpoints(tmp_path / "job-a")] == [2, STOP_AFTER], (
        "the source job's storage is left alone"
    )
    assert [c.step for c in committed_checkpoints(tmp_path / "job-b")][-1] == STEPS


def test_resume_from_must_name_an_existing_job(db: Database) -> None:
    with session_scope(db.sessions) as session:
        source = submit_job(session, JobSpec(name="source", model="mlp")).id
    with session_scope(db.sessions) as session:
        follower = submit_job(session, JobSpec(name="follower", model="mlp", resume_from=source))
        assert follower.spec["resume_from"] == source
    with pytest.raises(InvalidSpec) as raised, session_scope(db.sessions) as session:
        submit_job(session, JobSpec(name="orphan", model="mlp", resume_from="no-such-job"))
    assert raised.value.errors[0]["loc"] == ["resume_from"] and "no-such-job" in str(raised.value)


def test_spec_hash_unchanged_without_resume_from() -> None:
    # The spec as it was before the optional fields existed.
    fields = SPEC.model_dump(
        mode="json",
        exclude={
            "resume_from": True,
            "code": True,
            "runtime_env": True,
            "command": True,
            "stop_grace_s": True,
            "preemptible": True,
            "checkpoint": {"keep_best", "in_memory"},
            "parallel": {"blocks"},
            "train": {
                "lr_schedule",
                "optimizer",
                "eval_every_steps",
                "grad_clip",
                "activation_checkpointing",
                "compile",
            },
        },
    )
    assert SPEC.spec_hash() == hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    assert SPEC.model_copy(update={"resume_from": "x"}).spec_hash() != SPEC.spec_hash()


RESIZE_STEPS, RESIZE_STOP_AFTER = 8, 4
RESIZE_STRATEGIES = ("ddp", "fsdp")


def _resize_spec(strategy: str) -> JobSpec:
    """The same global batch at every world size in [1, 3]: 24 = 4 per micro-step × 6, 3 or 2 accumulation steps."""
    return JobSpec.model_validate(
        {
            **SPEC.model_dump(),
            "name": f"resize-{strategy}",
            "strategy": strategy,
            "workers": {"min": 1, "max": 3},
            "train": {**SPEC.train.model_dump(), "steps": RESIZE_STEPS, "global_batch_size": 24},
        }
    )


def _straight_and_stopped_at_two_ranks(rank: int, world_size: int, root: str) -> None:
    for strategy in RESIZE_STRATEGIES:
        straight, stopped = [], []
        spec = _resize_spec(strategy)
        run_training(
            spec,
            TrainContext(
                rank,
                world_size,
                torch.device("cpu"),
                "s",
                f"{root}/{strategy}/straight",
                sink=CallbackSink(on_metric=straight.append),
            ),
        )
        calls = itertools.count(1)
        run_training(
            spec,
            TrainContext(
                rank,
                world_size,
                torch.device("cpu"),
                "a",
                f"{root}/{strategy}/job-a",
                sink=CallbackSink(
                    on_metric=stopped.append, should_stop=lambda calls=calls: next(calls) >= RESIZE_STOP_AFTER
                ),
            ),
        )
        if rank == 0:
            Path(root, strategy, "two-ranks.json").write_text(
                json.dumps(
                    {
                        name: [[p.step, p.loss, p.world_size] for p in points if p.loss is not None]
                        for name, points in (("straight", straight), ("a", stopped))
                    }
                )
            )


def _resume_from_job_a(rank: int, world_size: int, root: str) -> None:
    for strategy in RESIZE_STRATEGIES:
        resumed = []
        spec = _resize_spec(strategy).model_copy(update={"resume_from": "job-a"})
        run_training(
            spec,
            TrainContext(
                rank,
                world_size,
                torch.device("cpu"),
                "b",
                f"{root}/{strategy}/job-b-{world_size}",
                sink=CallbackSink(on_metric=resumed.append),
                resume_from_root=f"{root}/{strategy}/job-a",
            ),
        )
        if rank == 0:
            Path(root, strategy, f"b-{world_size}.json").write_text(
                json.dumps([[p.step, p.loss, p.world_size] for p in resumed if p.loss is not None])
            )


@pytest.fixture(scope="module")
def resized_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("resize")
    run_on_ranks(_straight_and_stopped_at_two_ranks, 2, str(root))
    for world_size in (1, 3):
        run_on_ranks(_resume_from_job_a, world_size, str(root))
    return root


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("strategy", RESIZE_STRATEGIES)
def test_resume_from_another_jobs_checkpoint_at_another_world_size_matches_uninterrupted_run(
    resized_runs: Path, strategy: str, world_size: int
) -> None:
    two_ranks = json.loads((resized_runs / strategy / "two-ranks.json").read_text())
    resumed = json.loads((resized_runs / strategy / f"b-{world_size}.json").read_text())
    [source] = [c for c in committed_checkpoints(resized_runs / strategy / "job-a") if c.step == RESIZE_STOP_AFTER]
    assert source.manifest["world_size"] == 2 and source.manifest["strategy"] == strategy

    assert [step for step, _, _ in resumed] == list(range(RESIZE_STOP_AFTER + 1, RESIZE_STEPS + 1))
    assert {size for _, _, size in resumed} == {world_size}
    straight = [loss for _, loss, _ in two_ranks["straight"]]
    assert [loss for _, loss, _ in two_ranks["a"]] == straight[:RESIZE_STOP_AFTER]
    assert [loss for _, loss, _ in resumed] == pytest.approx(straight[RESIZE_STOP_AFTER:], abs=1e-4)
    # The loss moves by far more than the tolerance over these steps, so matching it is not trivial.
    assert abs(straight[-1] - straight[RESIZE_STOP_AFTER]) > 1e-2


def _ray_spec(name: str, steps: int, **overrides) -> dict:
    return {
        "name": name,
        "model": "tiny-gpt",
        "model_options": {"n_layers": 1, "dim": 32, "n_heads": 2, "seq_len": 32},
        "workers": {"min": 2, "max": 2, "cpus_per_worker": 1},
        "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "lr": 0.003, "seed": 5},
        "checkpoint": {"every_steps": 2, "keep": 3},
        **overrides,
    }


@pytest.mark.integration
def test_job_resuming_from_a_corrupt_newest_checkpoint_on_ray_uses_the_previous_one_and_says_so(
    client: RingmasterClient,
) -> None:
    source = client.submit(_ray_spec("corrupt-source", 6))
    done = wait_for_state(client, source["id"], {"SUCCEEDED", "FAILED"})
    assert done["state"] == "SUCCEEDED", done["error"]
    assert [c["step"] for c in client.checkpoints(source["id"])["items"]] == [2, 4, 6]
    newest = Path(client.checkpoints(source["id"])["items"][-1]["uri"])
    shard = newest / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])

    follower = client.submit(_ray_spec("corrupt-follower", 8, resume_from=source["id"]))
    done = wait_for_state(client, follower["id"], {"SUCCEEDED", "FAILED"})
    assert done["state"] == "SUCCEEDED", done["error"]

    [event] = [e for e in client.events(follower["id"])["items"] if "is corrupt" in (e["message"] or "")]
    assert event["kind"] == "info"
    assert event["message"].startswith(
        "checkpoint step 6 is corrupt (step-00000006/__1_0.distcp: 100 bytes, manifest says "
    )
    assert event["message"].endswith("); resumed from step 4")
    assert event["data"]["resumed_from_step"] == 4 and event["data"]["corrupt_checkpoints"][0]["uri"] == str(newest)
    source_losses = {
        row["step"]: row["loss"] for row in client.metrics(source["id"])["items"] if row["loss"] is not None
    }
    follower_losses = {
        row["step"]: row["loss"] for row in client.metrics(follower["id"])["items"] if row["loss"] is not None
    }
    assert sorted(follower_losses) == [5, 6, 7, 8]
    # Steps 5 and 6 retrace the source job's from its step-4 checkpoint, at the same world size.
    assert [follower_losses[step] for step in (5, 6)] == pytest.approx(
        [source_losses[step] for step in (5, 6)], abs=1e-6
    )
