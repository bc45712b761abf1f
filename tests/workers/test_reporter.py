"""The driver's reporter reads each answer: the attempt ended, or it is preempted (for which job)."""

from __future__ import annotations

import httpx

from ringmaster.workers.reporter import Reporter


def _reporter_answering(answers: list[dict]) -> Reporter:
    reporter = Reporter("http://control-plane", "job-1", 1, flush_interval_s=3600)
    pending = list(answers)
    reporter._client = httpx.Client(
        transport=httpx.MockTransport(lambda request: httpx.Response(200, json=pending.pop(0)))
    )
    return reporter


def test_an_answer_that_preempts_the_attempt_names_the_job_it_makes_room_for() -> None:
    reporter = _reporter_answering(
        [
            {"state": "RUNNING", "accepted": True},
            {"state": "RUNNING", "accepted": True, "preempting": True, "preempted_for": "job-high"},
        ]
    )
    reporter.report(message="one")
    assert reporter.close(timeout_s=5)
    assert not reporter.preempting.is_set(), "the first answer does not preempt"
    reporter = _reporter_answering(
        [{"state": "RUNNING", "accepted": True, "preempting": True, "preempted_for": "job-high"}]
    )
    reporter.report(message="two")
    reporter.close(timeout_s=5)
    assert reporter.preempting.is_set() and reporter.preempted_for == "job-high"
    assert not reporter.ended.is_set(), "preempted, the attempt still reports until it has saved"


def test_a_refused_report_ends_the_attempt() -> None:
    reporter = _reporter_answering([{"state": "PREEMPTED", "accepted": False}])
    reporter.report(state="PREEMPTED")
    reporter.close(timeout_s=5)
    assert reporter.ended.is_set() and reporter.ended_state == "PREEMPTED"
