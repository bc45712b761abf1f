"""JobSpec.resume_from: a new job starts from another job's newest usable checkpoint; the id must exist."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import pytest
import torch

from process_group import run_on_ranks
from service.db import Database, session_scope
from service.errors import InvalidSpec
from service.jobs import submit_job
from service.spec import JobSpec
from test_checkpoint import SPEC, STEPS
from workers.checkpoint import committed_checkpoints
from workers.training import TrainContext, run_training

STOP_AFTER = 4


def _train_stop_then_continue_in_another_job(rank: int, world_size: int, root: str) -> None:
    straight, first, second = [], [], []
    run_training(SPEC, TrainContext(rank, world_size, torch.device("cpu"), "s", f"{root}/straight", on_metric=straight.append))
    calls = itertools.count(1)
    run_training(SPEC, TrainContext(rank, world_size, torch.device("cpu"), "a", f"{root}/job-a", on_metric=first.append,
                                    should_stop=lambda: next(calls) >= STOP_AFTER))
    spec_b = SPEC.model_copy(update={"resume_from": "job-a"})
    run_training(spec_b, TrainContext(rank, world_size, torch.device("cpu"), "b", f"{root}/job-b", on_metric=second.append,
                                      resume_from_root=f"{root}/job-a"))
    if rank == 0:
        Path(root, "summary.json").write_text(json.dumps({
            name: [[p.step, p.loss] for p in points if p.loss is not None]
            for name, points in (("straight", straight), ("a", first), ("b", second))
        }))


def test_new_job_continues_from_another_jobs_checkpoint(tmp_path: Path) -> None:
    run_on_ranks(_train_stop_then_continue_in_another_job, 2, str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())

    assert [step for step, _ in summary["b"]] == list(range(STOP_AFTER + 1, STEPS + 1))
    assert [loss for _, loss in summary["a"] + summary["b"]] == [loss for _, loss in summary["straight"]]
    assert [c.step for c in committed_checkpoints(tmp_path / "job-a")] == [2, STOP_AFTER], "the source job's storage is left alone"
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
    fields = SPEC.model_dump(mode="json", exclude={"resume_from": True, "checkpoint": {"keep_best"}})
    assert SPEC.spec_hash() == hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    assert SPEC.model_copy(update={"resume_from": "x"}).spec_hash() != SPEC.spec_hash()
