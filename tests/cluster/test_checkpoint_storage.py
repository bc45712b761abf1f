"""Checkpoints on fsspec storage: two ranks save (asynchronously), resume, apply retention and skip a
corrupt checkpoint on a real S3 protocol (moto's server), exactly as on a local directory; single-process
parts also on ``memory://``."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch

from harness.checkpoints import load_model_weights
from harness.local_control_plane import running_control_plane, wait_for_state
from harness.process_group import run_on_ranks
from harness.s3_server import s3_server
from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec, KeepBestSpec
from ringmaster.workers.checkpoint.durable import (
    begin_save,
    checkpoint_dir,
    checkpoint_metrics,
    commit_save,
    committed_checkpoints,
    find_resume_point,
    load_checkpoint,
)
from ringmaster.workers.checkpoint.storage import FsspecStorage, LocalStorage, storage_for
from ringmaster.workers.data.stream import DataPosition
from ringmaster.workers.models import build_bundle
from ringmaster.workers.trainer import TrainContext, run_training
from tests.workers.checkpoint.test_durable import SPEC, STEPS

BUCKET = "ringmaster-checkpoints"
STOP_AT = 4
# The loss falls, so "max" makes the best an old checkpoint that retention must keep besides the newest two.
S3_SPEC = JobSpec.model_validate(
    {**SPEC.model_dump(), "checkpoint": {"every_steps": 2, "keep": 2, "keep_best": {"metric": "loss", "mode": "max"}}}
)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on a free local port, with the bucket; the endpoint reaches s3fs (and the spawned
    ranks, which inherit the environment) through AWS_ENDPOINT_URL_S3, as it would on a real cluster."""
    with s3_server(BUCKET) as endpoint:
        yield endpoint


def _save_stop_corrupt_resume(rank: int, world_size: int, root: str, s3_root: str) -> None:
    """A straight local run; on S3 a run stopped at step 4 (an async save at 2, the stop's at 4), its
    step-4 shard truncated, then resumed: the ranks must agree to skip it and continue from step 2."""
    straight, before, after, records, events = [], [], [], [], []

    def context(storage: str, metrics: list, **callbacks) -> TrainContext:
        return TrainContext(
            rank,
            world_size,
            torch.device("cpu"),
            "s3",
            storage,
            sink=CallbackSink(on_metric=metrics.append, on_checkpoint=records.append, **callbacks),
        )

    run_training(
        S3_SPEC,
        TrainContext(
            rank,
            world_size,
            torch.device("cpu"),
            "local",
            f"{root}/straight",
            sink=CallbackSink(on_metric=straight.append),
        ),
    )
    calls = itertools.count(1)
    run_training(S3_SPEC, context(s3_root, before, should_stop=lambda: next(calls) >= STOP_AT))
    if rank == 0:
        s3 = fsspec.filesystem("s3")
        shard = f"{checkpoint_dir(s3_root, STOP_AT)}/__1_0.distcp"
        s3.pipe_file(shard, s3.cat_file(shard)[:100])
    torch.distributed.barrier()
    # The control plane has stored all but the two newest points: the final checkpoint keeps those two.
    run_training(
        S3_SPEC,
        context(
            s3_root,
            after,
            on_event=lambda message, details: events.append([message, details]),
            metrics_confirmed=lambda: max(0, len(after) - 2),
        ),
    )
    if rank == 0:
        Path(root, "summary.json").write_text(
            json.dumps(
                {
                    "straight": [[p.step, p.loss] for p in straight if p.loss is not None],
                    "before": [[p.step, p.loss] for p in before if p.loss is not None],
                    "after": [[p.step, p.loss] for p in after if p.loss is not None and p.attempt is None],
                    "replayed": [p.step for p in after if p.attempt is not None],  # what the resumed checkpoint kept
                    "records": [record.model_dump() for record in records],
                    "events": events,
                }
            )
        )


def test_two_ranks_on_s3_save_async_resume_skip_corrupt_and_keep_newest_plus_best(
    tmp_path: Path, s3_endpoint: str
) -> None:
    s3_root = f"s3://{BUCKET}/checkpoints/job-1"
    run_on_ranks(_save_stop_corrupt_resume, 2, str(tmp_path), s3_root)
    summary = json.loads((tmp_path / "summary.json").read_text())
    straight = dict(summary["straight"])

    assert [step for step, _ in summary["before"]] == list(range(1, STOP_AT + 1))
    assert [step for step, _ in summary["after"]] == list(range(3, STEPS + 1)), (
        "resume must skip the corrupt step 4 for step 2"
    )
    assert summary["replayed"] == [1, 2], "step 2's checkpoint keeps its steps' points in S3 too"
    # S3 storage changes nothing numerically: the stopped and resumed run is the local straight run.
    assert [loss for step, loss in summary["before"] + summary["after"]] == [
        straight[s] for s in range(1, STOP_AT + 1)
    ] + [straight[s] for s in range(3, STEPS + 1)]
    # Besides the checkpoint's: the composition's report of its layout (workers/strategies/decisions.py).
    checkpoint_events = [event for event in summary["events"] if "parallel_layout" not in event[1]]
    restored, corrupt = (
        [event for event in checkpoint_events if ("is corrupt" in event[0]) == flag] for flag in (False, True)
    )
    assert [details["restored_step"] for _, details in restored] == [2] and restored[0][1]["restore_s"] > 0
    [[message, details]] = corrupt
    assert message.startswith(
        f"checkpoint step {STOP_AT} is corrupt (step-0000000{STOP_AT}/__1_0.distcp: 100 bytes, manifest says "
    )
    assert message.endswith("); resumed from step 2") and details["corrupt_checkpoints"][0]["uri"] == checkpoint_dir(
        s3_root, STOP_AT
    )

    records = summary["records"]
    assert straight[2] > max(straight[4], straight[6]), "the run must make step 2 the best by mode max"
    assert [(r["step"], r["final"]) for r in records] == [(2, False), (4, False), (4, False), (6, True)]
    assert all(r["uri"].startswith(f"{s3_root}/step-") and r["metric"] == "loss" for r in records)
    # Each checkpoint's metric is the loss of the step it was taken at.
    assert [r["metric_value"] for r in records[2:]] == [straight[4], straight[6]]
    assert records[0]["metric_value"] == straight[2]
    best_step = max((2, 4, 6), key=lambda step: (straight[step], step))
    kept = sorted({4, 6, best_step})
    assert records[-1]["best_uri"] == checkpoint_dir(s3_root, best_step)
    assert [c.step for c in committed_checkpoints(s3_root)] == kept
    assert records[-1]["deleted_uris"] == ([checkpoint_dir(s3_root, 2)] if best_step != 2 else [])
    # What the control plane's checkpoint rows become: the same URIs as the records name.
    assert [(stored["step"], stored["uri"], stored["world_size"]) for stored in records[-1]["kept"]] == [
        (step, checkpoint_dir(s3_root, step), 2) for step in kept
    ]
    s3 = fsspec.filesystem("s3")
    s3.invalidate_cache()
    assert sorted(name.rsplit("/", 1)[-1] for name in s3.ls(s3_root)) == [f"step-{step:08d}" for step in kept]
    final = json.loads(s3.cat_file(f"{checkpoint_dir(s3_root, STEPS)}/manifest.json"))
    assert set(final["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp", "metrics.json"}
    assert [point["step"] for point in checkpoint_metrics(committed_checkpoints(s3_root)[-1])] == [5, 6]

    straight_model, s3_model = build_bundle(S3_SPEC).model, build_bundle(S3_SPEC).model
    load_model_weights(checkpoint_dir(tmp_path / "straight", STEPS), straight_model)
    load_model_weights(checkpoint_dir(s3_root, STEPS), s3_model)
    for (name, expected), actual in zip(straight_model.state_dict().items(), s3_model.state_dict().values()):
        assert torch.equal(actual, expected), name


def test_memory_uri_round_trip_retention_and_corruption(single_rank_group: None) -> None:
    """fsspec's in-process memory filesystem: save, list, keep the newest plus the best, detect a truncated shard,
    load."""
    root = "memory://ringmaster-tests/round-trip"
    spec = S3_SPEC.model_copy(
        update={
            "workers": S3_SPEC.workers.model_copy(update={"min": 1, "max": 1}),
            "checkpoint": S3_SPEC.checkpoint.model_copy(update={"keep": 1, "keep_best": KeepBestSpec(metric="loss")}),
        }
    )
    bundle = build_bundle(spec)
    optimizer = torch.optim.AdamW(bundle.model.parameters())
    committed = []
    for step, value in ((1, 3.0), (2, 1.0), (3, 2.0)):
        pending = begin_save(
            root,
            spec,
            step=step,
            position=DataPosition(0, step),
            model_parts=[bundle.model],
            optimizers=[optimizer],
            metric_value=value,
        )
        committed.append(commit_save(pending))
    assert [c.retention.best for c in committed] == [
        checkpoint_dir(root, 1),
        checkpoint_dir(root, 2),
        checkpoint_dir(root, 2),
    ]
    assert [c.retention.deleted for c in committed] == [[], [checkpoint_dir(root, 1)], []]
    assert [(c.step, c.manifest["metric_value"]) for c in committed_checkpoints(root)] == [(2, 1.0), (3, 2.0)]
    saved = {name: tensor.clone() for name, tensor in bundle.model.state_dict().items()}

    memory = fsspec.filesystem("memory")
    shard = f"{checkpoint_dir(root, 3)}/__0_0.distcp"
    memory.pipe_file(shard, memory.cat_file(shard)[:-1])
    newest, skipped = find_resume_point(root)
    assert newest.step == 2 and [(c.step, problem.split(":")[0]) for c, problem in skipped] == [
        (3, "step-00000003/__0_0.distcp")
    ]

    with torch.no_grad():
        for parameter in bundle.model.parameters():
            parameter.zero_()
    assert load_checkpoint(newest.path, model_parts=[bundle.model], optimizers=[optimizer]).position == DataPosition(
        0, 2
    )
    assert all(torch.equal(bundle.model.state_dict()[name], tensor) for name, tensor in saved.items())
    memory.rm(root, recursive=True)


def test_storage_is_chosen_by_uri(tmp_path: Path) -> None:
    assert storage_for(tmp_path) == (storage_for(str(tmp_path))[0], str(tmp_path))
    local, path = storage_for(f"file://{tmp_path}/x")
    assert isinstance(local, LocalStorage) and path == f"{tmp_path}/x"
    remote, uri = storage_for("memory://bucket/x")
    assert isinstance(remote, FsspecStorage) and uri == "memory://bucket/x"
    with pytest.raises(ValueError, match="file:// URI names a path on this machine"):
        storage_for("file://elsewhere/x")
    with pytest.raises(ValueError, match="checkpoint storage 'nosuchprotocol://x'"):
        storage_for("nosuchprotocol://x")


@pytest.fixture(scope="module")
def s3_control_plane(s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory):
    """A Ray head started with the S3 endpoint in its environment (drivers and workers inherit it), and a
    control plane whose RINGMASTER_STORAGE_URI is a bucket."""
    yield from running_control_plane(tmp_path_factory.mktemp("s3-plane"), storage_uri=f"s3://{BUCKET}/plane")


@pytest.mark.integration
def test_job_on_ray_checkpoints_to_s3_and_its_rows_follow_retention(s3_control_plane) -> None:
    client = s3_control_plane.client()
    job = client.submit(
        {
            "name": "s3-job",
            "model": "tiny-gpt",
            "model_options": {"n_layers": 1, "dim": 32, "n_heads": 2, "seq_len": 32},
            "workers": {"min": 2, "max": 2, "cpus_per_worker": 1},
            "train": {"steps": 6, "global_batch_size": 8, "micro_batch_size": 2, "lr": 0.003, "seed": 5},
            "checkpoint": {"every_steps": 2, "keep": 1, "keep_best": {"metric": "val_loss"}},
        }
    )
    done = wait_for_state(client, job["id"], {"SUCCEEDED", "FAILED"})
    assert done["state"] == "SUCCEEDED", done["error"]

    job_root = f"s3://{BUCKET}/plane/{job['id']}"
    val = {row["step"]: row["val_loss"] for row in client.metrics(job["id"])["items"] if row["val_loss"] is not None}
    assert sorted(val) == [2, 4, 6], "val_loss is evaluated at every checkpoint"
    best_step = min(val, key=lambda step: (val[step], -step))
    kept = sorted({6, best_step})
    rows = client.checkpoints(job["id"])["items"]
    assert [(row["step"], row["uri"]) for row in rows] == [(step, checkpoint_dir(job_root, step)) for step in kept]
    assert [(row["metric"], row["metric_value"], row["best"]) for row in rows] == [
        ("val_loss", val[step], step == best_step) for step in kept
    ]
    assert [c.step for c in committed_checkpoints(job_root)] == kept, "the rows are what is on S3"
    announced = [e["data"]["step"] for e in client.events(job["id"])["items"] if e["kind"] == "checkpoint"]
    assert announced == [2, 4, 6]


def test_sample_id_record_needs_a_local_storage_root(single_rank_group: None) -> None:
    spec = JobSpec.model_validate(
        {
            **SPEC.model_dump(),
            "workers": {"min": 1, "max": 1},
            "train": {**SPEC.train.model_dump(), "record_sample_ids": True},
        }
    )
    with pytest.raises(
        ValueError,
        match=r"train.record_sample_ids writes its record to a local directory, and this job's "
        r"storage is 'memory://ringmaster-tests/audit'",
    ):
        run_training(spec, TrainContext(0, 1, torch.device("cpu"), "audit", "memory://ringmaster-tests/audit"))
