"""The reconciler on a fake cluster: one job's failure does not stall the others, and its logs name the job."""

from __future__ import annotations

import logging

import pytest

from ringmaster.service.db import Database
from ringmaster.service.dispatcher import Dispatcher
from ringmaster.service.models import Job
from ringmaster.service.settings import Settings
from ringmaster.service.states import JobState
from tests.service.test_dispatcher import FakeCluster, _spec, _submit


class FlakyStatusCluster(FakeCluster):
    """status() raises for one submission id, as Ray's Jobs API does when it times out."""

    def __init__(self, cpus: int, broken: str) -> None:
        super().__init__(cpus)
        self.broken = broken

    def status(self, submission_id: str) -> str | None:
        if submission_id == self.broken:
            raise RuntimeError("Jobs API timed out")
        return super().status(submission_id)


def test_a_job_ray_cannot_answer_for_does_not_stall_the_others(db: Database, caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings(api_url="http://cp", storage_uri="/ckpt", driver_python="python3")
    cluster = FlakyStatusCluster(cpus=4, broken="")
    dispatcher = Dispatcher(db.sessions, cluster, settings, owner="d")
    unanswered, lost = _submit(db, _spec("unanswered", workers=2)), _submit(db, _spec("lost", workers=2))
    dispatcher.run_once()
    cluster.broken = f"ringmaster-{unanswered}-1"
    cluster.ray_status[f"ringmaster-{lost}-1"] = "FAILED"  # its driver was killed
    with caplog.at_level(logging.INFO, logger="ringmaster.service.dispatcher"):
        dispatcher.run_once()
    with db.sessions() as session:
        assert (session.get(Job, lost).attempt, session.get(Job, lost).failures) == (2, 1)
        assert session.get(Job, unanswered).state == JobState.ADMITTED, "a job Ray could not answer for is left alone"
    failed = [r for r in caplog.records if r.getMessage() == f"reconciling job {unanswered} failed"]
    assert len(failed) == 1 and failed[0].job_id == unanswered and "Jobs API timed out" in failed[0].exc_text
    resubmitted = [r for r in caplog.records if "without the driver reporting; resubmitting" in r.getMessage()]
    assert [(r.job_id, r.attempt) for r in resubmitted] == [(lost, 1)]
    assert all(getattr(r, "job_id", None) for r in caplog.records), [r.getMessage() for r in caplog.records]
