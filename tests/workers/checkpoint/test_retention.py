"""checkpoint.keep_best: each checkpoint records its metric (val_loss evaluated at the checkpoint without
disturbing training), retention keeps the best besides the newest, and the job's checkpoint rows follow storage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from pydantic import ValidationError
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from harness.checkpoints import load_model_weights
from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.api.schemas import CheckpointOut
from ringmaster.service.db import Database, session_scope
from ringmaster.service.jobs import (
    apply_driver_report,
    get_job,
    list_checkpoints,
    list_events,
    mark_admitted,
    submit_job,
)
from ringmaster.service.reports import CheckpointRecord, DriverReport, StoredCheckpoint
from ringmaster.service.settings import Settings
from ringmaster.service.spec import JobSpec
from ringmaster.workers.checkpoint.durable import checkpoint_dir, committed_checkpoints
from ringmaster.workers.models import ModelBundle, build_bundle
from ringmaster.workers.rank_process import RankOutbox
from ringmaster.workers.trainer import TrainContext, run_training
from tests.workers.checkpoint.test_durable import SPEC, STEPS

VAL_SPEC = JobSpec.model_validate(
    {**SPEC.model_dump(), "checkpoint": {"every_steps": 2, "keep": 1, "keep_best": {"metric": "val_loss"}}}
)


def _with_and_without_validation_at_checkpoints(rank: int, world_size: int, root: str) -> None:
    runs: dict[str, dict[str, list]] = {}
    for name, spec in (("plain", SPEC), ("best", VAL_SPEC)):
        metrics, records = [], []
        result = run_training(
            spec,
            TrainContext(
                rank,
                world_size,
                torch.device("cpu"),
                name,
                f"{root}/{name}",
                sink=CallbackSink(on_metric=metrics.append, on_checkpoint=records.append),
            ),
        )
        runs[name] = {
            "losses": [[p.step, p.loss] for p in metrics if p.loss is not None],
            "val": [[p.step, p.val_loss] for p in metrics if p.val_loss is not None],
            "records": [record.model_dump() for record in records],
            "result_val": [result.val_loss],
        }
    if rank == 0:
        Path(root, "summary.json").write_text(json.dumps(runs))


def _validation_loss(spec: JobSpec, checkpoint: str, world_size: int) -> float:
    """The mean validation loss of a checkpoint's weights in one plain process, over the samples that
    ``world_size`` data-parallel ranks evaluate (each takes len // world_size)."""
    bundle = build_bundle(spec)
    load_model_weights(checkpoint, bundle.model)
    bundle.model.eval()
    evaluated = len(bundle.val_dataset) // world_size * world_size
    total = 0.0
    with torch.no_grad():
        for start, batch in zip(
            range(0, evaluated, 64), DataLoader(Subset(bundle.val_dataset, range(evaluated)), batch_size=64)
        ):
            total += bundle.loss_fn(bundle.model, batch).double().item() * (min(start + 64, evaluated) - start)
    return total / evaluated


def _saved_torch_rng(checkpoint: str) -> torch.Tensor:
    state = {"rng": {"rank0": {"torch": torch.get_rng_state()}}}
    dcp.load(state, checkpoint_id=checkpoint)
    return state["rng"]["rank0"]["torch"]


def test_val_loss_is_evaluated_at_each_checkpoint_recorded_and_leaves_training_unchanged(tmp_path: Path) -> None:
    run_on_ranks(_with_and_without_validation_at_checkpoints, 2, str(tmp_path))
    runs = json.loads((tmp_path / "summary.json").read_text())
    plain, best = runs["plain"], runs["best"]

    assert best["losses"] == plain["losses"] and len(plain["losses"]) == STEPS
    assert [step for step, _ in plain["val"]] == [STEPS]
    assert [step for step, _ in best["val"]] == [2, 4, 6]
    assert best["val"][-1] == plain["val"][-1] and best["result_val"] == [best["val"][-1][1]], (
        "the final validation is reused"
    )
    val = dict(best["val"])
    records = best["records"]
    assert [(r["step"], r["metric"], r["metric_value"]) for r in records] == [
        (step, "val_loss", val[step]) for step in (2, 4, 6)
    ]
    best_step = min(val, key=lambda step: (val[step], -step))
    assert records[-1]["best_uri"] == checkpoint_dir(tmp_path / "best", best_step)
    assert [c.step for c in committed_checkpoints(tmp_path / "best")] == sorted({STEPS, best_step})
    assert [c.manifest["metric_value"] for c in committed_checkpoints(tmp_path / "best")] == [
        val[s] for s in sorted({STEPS, best_step})
    ]
    # Validating drew nothing from the training RNG: the final checkpoints hold the same RNG state.
    assert torch.equal(
        _saved_torch_rng(checkpoint_dir(tmp_path / "best", STEPS)),
        _saved_torch_rng(checkpoint_dir(tmp_path / "plain", STEPS)),
    )
    for step in sorted({STEPS, best_step}):
        assert _validation_loss(VAL_SPEC, checkpoint_dir(tmp_path / "best", step), world_size=2) == pytest.approx(
            val[step], abs=1e-5
        )


def no_validation_set() -> ModelBundle:
    """A user model that brings no validation set."""
    inputs = torch.randn(16, 4)
    return ModelBundle(
        nn.Linear(4, 1),
        TensorDataset(inputs, inputs.sum(1, keepdim=True)),
        None,
        lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1]),
    )


def test_val_loss_without_a_validation_set_is_refused_before_training(tmp_path: Path, single_rank_group: None) -> None:
    spec = JobSpec(
        name="no-val",
        model=f"{__name__}:no_validation_set",
        data="user",
        train={"steps": 2, "global_batch_size": 4, "micro_batch_size": 4},
        checkpoint={"every_steps": 1, "keep_best": {"metric": "val_loss"}},
    )
    with pytest.raises(ValueError, match=r"checkpoint.keep_best.metric 'val_loss' needs a validation set"):
        run_training(spec, TrainContext(0, 1, torch.device("cpu"), "no-val", str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("checkpoint", "message"),
    [
        ({"every_steps": 10, "keep_best": {"metric": "top 5"}}, "checkpoint.keep_best.metric"),
        ({"every_steps": 10, "keep_best": {"metric": "loss", "mode": "lowest"}}, "checkpoint.keep_best.mode"),
        ({"every_steps": 10, "keep_best": {"metric": "loss", "window": 3}}, "checkpoint.keep_best.window"),
        ({"every_steps": 0, "keep_best": {"metric": "loss"}}, "checkpoint.keep_best needs periodic checkpoints"),
    ],
)
def test_keep_best_is_validated(checkpoint: dict, message: str) -> None:
    with pytest.raises(ValidationError) as raised:
        JobSpec(name="bad", model="mlp", checkpoint=checkpoint)
    described = "; ".join(f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in raised.value.errors())
    assert message in described


def _record(step: int, value: float, best: int, deleted: tuple[int, ...] = ()) -> CheckpointRecord:
    uri = lambda s: f"s3://bucket/job/step-{s:08d}"  # noqa: E731
    return CheckpointRecord(
        step=step,
        uri=uri(step),
        world_size=2,
        metric="val_loss",
        metric_value=value,
        best_uri=uri(best),
        deleted_uris=[uri(s) for s in deleted],
    )


def test_checkpoint_rows_follow_retention_and_mark_the_best(db: Database) -> None:
    with session_scope(db.sessions) as session:
        job_id = submit_job(
            session,
            JobSpec(
                name="best", model="mlp", checkpoint={"every_steps": 2, "keep": 1, "keep_best": {"metric": "val_loss"}}
            ),
        ).id
        mark_admitted(session, get_job(session, job_id), 1, f"ringmaster-{job_id}-1", "pg", 2)
    reports = [
        [_record(2, 3.0, best=2), _record(4, 1.0, best=4, deleted=(2,))],
        [_record(6, 2.0, best=4)],
        # Stored and deleted within one report: step 8 is gone when step 10 commits.
        [_record(8, 2.5, best=4, deleted=(6,)), _record(10, 0.5, best=10, deleted=(8, 4))],
    ]
    seen = []
    for seq, records in enumerate(reports, start=1):
        with session_scope(db.sessions) as session:
            assert apply_driver_report(session, job_id, 1, DriverReport(seq=seq, checkpoints=records)).accepted
        with session_scope(db.sessions) as session:
            seen.append(
                [
                    (c.step, c.metric_value, c.best)
                    for c in map(CheckpointOut.model_validate, list_checkpoints(session, job_id).items)
                ]
            )
    assert seen == [[(4, 1.0, True)], [(4, 1.0, True), (6, 2.0, False)], [(10, 0.5, True)]]
    with session_scope(db.sessions) as session:
        [out] = map(CheckpointOut.model_validate, list_checkpoints(session, job_id).items)
        messages = [event.message for event in list_events(session, job_id).items if event.kind == "checkpoint"]
    assert out.metric == "val_loss" and out.uri == "s3://bucket/job/step-00000010"
    assert messages == [
        f"checkpoint at step {step} (val_loss {value:g})"
        for step, value in ((2, 3.0), (4, 1.0), (6, 2.0), (8, 2.5), (10, 0.5))
    ]


def test_checkpoint_rows_become_what_storage_keeps_when_a_commits_record_was_lost(
    db: Database, tmp_path: Path, single_rank_group: None
) -> None:
    # Rank 0 lost between its commit of step 3 (whose retention deleted step 1) and its report: that record never
    # reaches the control plane, which would go on listing step 1 and never list step 3.
    spec = JobSpec(
        name="lost-record",
        model="mlp",
        train={"steps": 5, "global_batch_size": 4, "micro_batch_size": 4},
        checkpoint={"every_steps": 1, "keep": 2},
    )
    records: list[CheckpointRecord] = []
    on_storage: list[list[int]] = []  # after each commit

    def committed(record: CheckpointRecord) -> None:
        records.append(record)
        on_storage.append([checkpoint.step for checkpoint in committed_checkpoints(tmp_path)])

    run_training(
        spec,
        TrainContext(
            0, 1, torch.device("cpu"), "lost-record", str(tmp_path), sink=CallbackSink(on_checkpoint=committed)
        ),
    )
    assert [record.step for record in records] == [1, 2, 3, 4, 5] and on_storage[2] == [2, 3]
    with session_scope(db.sessions) as session:
        job_id = submit_job(session, spec).id
        mark_admitted(session, get_job(session, job_id), 1, f"ringmaster-{job_id}-1", "pg", 1)
    listed = {}
    for seq, record in enumerate(records, start=1):
        if record.step == 3:
            continue
        with session_scope(db.sessions) as session:
            assert apply_driver_report(session, job_id, 1, DriverReport(seq=seq, checkpoints=[record])).accepted
        with session_scope(db.sessions) as session:
            listed[record.step] = [
                (row.step, row.uri, row.world_size) for row in list_checkpoints(session, job_id).items
            ]
    assert {step: [row[0] for row in rows] for step, rows in listed.items()} == {
        1: [1],
        2: [1, 2],
        4: [3, 4],
        5: [4, 5],
    }
    assert listed[4][0] == (3, checkpoint_dir(tmp_path, 3), 1)
    with session_scope(db.sessions) as session:
        messages = [event.message for event in list_events(session, job_id).items if event.kind == "checkpoint"]
    assert "checkpoint at step 3 (committed by a worker lost before it reported it)" in messages


def test_a_drain_of_many_commits_reports_what_storage_keeps_once_within_the_api_limit() -> None:
    # checkpoint.keep at its largest (1000) and a commit every step: 45 commits in one second's drain.
    uri = lambda s: f"s3://bucket/job/step-{s:08d}"  # noqa: E731
    committed = [
        CheckpointRecord(
            step=step,
            uri=uri(step),
            world_size=2,
            kept=[StoredCheckpoint(step=kept, uri=uri(kept), world_size=2) for kept in range(step - 999, step + 1)],
        )
        for step in range(2000, 2045)
    ]
    outbox = RankOutbox()
    for record in committed:
        outbox.checkpoint(record)
    records = [CheckpointRecord(**record) for record in outbox.drain(None)["checkpoints"]]
    assert [record.step for record in records] == list(range(2000, 2045))
    assert [record.kept is None for record in records] == [True] * 44 + [False]
    assert [stored.step for stored in records[-1].kept] == list(range(1045, 2045))
    limit = Settings.model_fields["max_request_bytes"].default
    assert len(DriverReport(seq=1, checkpoints=records).model_dump_json()) < limit
    assert len(DriverReport(seq=1, checkpoints=committed).model_dump_json()) > limit
