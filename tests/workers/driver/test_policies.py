"""The driver's policies decide from counts alone: checked here against a fake worker group, without Ray."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ringmaster.service.spec import WorkersSpec
from ringmaster.workers.driver.policies import (
    FailJob,
    FailurePolicy,
    FormGroup,
    GiveUp,
    Recover,
    ScalingPolicy,
    WaitForCapacity,
)
from ringmaster.workers.job_input import JobInputError


@dataclass
class FakeGroup:
    world_size: int
    warm_ready: int = 0
    warm_starting: int = 0


@dataclass
class FakeWorker:
    rank: int
    node_id: str


class FakeTaskError(Exception):
    """As Ray's RayTaskError: the remote traceback as its text, the exception raised remotely as `cause`."""

    def __init__(self, text: str, cause: BaseException | None = None) -> None:
        super().__init__(text)
        self.cause = cause


def _scaling(min_: int, max_: int, standby: int = 0) -> ScalingPolicy:
    return ScalingPolicy(WorkersSpec(min=min_, max=max_, standby=standby), capacity_wait_s=60)


def test_lost_workers_are_recovered_from_and_named() -> None:
    decision = FailurePolicy().decide([FakeWorker(1, "node-b" * 4), FakeWorker(3, "node-d" * 4)], [])
    assert decision == Recover("lost rank(s) [1, 3] on node(s) ['node-bnode-b', 'node-dnode-d']")  # ids cut to 12


def test_a_collective_failing_with_everyone_alive_is_recovered_from_but_the_users_error_fails_the_job() -> None:
    broken_pipe = FakeTaskError("gloo: Connection reset by peer")
    assert isinstance(FailurePolicy().decide([], [broken_pipe]), Recover)
    decision = FailurePolicy().decide([], [broken_pipe, FakeTaskError("train()\nValueError: bad batch")])
    assert isinstance(decision, FailJob) and "ValueError: bad batch" in decision.reason


def test_a_job_input_error_fails_the_job_with_its_message_alone_before_any_collective_failure_is_weighed() -> None:
    refused = JobInputError("data.path: data file '/nope/text.bin' does not exist on this node")
    errors = [
        FakeTaskError("gloo: Connection reset by peer"),
        FakeTaskError(f"train()\nTraceback ...\nJobInputError: {refused}", cause=refused),
    ]
    assert FailurePolicy().decide([], errors) == FailJob(str(refused)) == FailJob(refused.reason)
    # Without one, a user's exception keeps its traceback.
    user = FakeTaskError("train()\n  File \"model.py\", line 3\nKeyError: 'x'", cause=KeyError("x"))
    decision = FailurePolicy().decide([], [user])
    assert isinstance(decision, FailJob) and "Traceback" in decision.reason and 'model.py", line 3' in decision.reason


@pytest.mark.parametrize(
    ("group", "grows"),
    [
        (FakeGroup(world_size=2, warm_ready=1), False),  # at max already
        (FakeGroup(world_size=1, warm_ready=0, warm_starting=1), False),  # nothing warm yet
        (FakeGroup(world_size=1, warm_ready=1), True),  # the one missing worker is warm
        (
            FakeGroup(world_size=0, warm_ready=1, warm_starting=1),
            False,
        ),  # one warm, another still warming: wait for both
        (FakeGroup(world_size=0, warm_ready=1, warm_starting=0), True),  # all that could start are warm
    ],
)
def test_the_group_stops_to_grow_once_its_missing_workers_are_warm(group: FakeGroup, grows: bool) -> None:
    assert _scaling(1, 2).should_grow(group) is grows


def test_warm_workers_wanted_are_the_missing_ones_and_the_standbys() -> None:
    assert _scaling(1, 4, standby=1).warm_wanted(FakeGroup(world_size=2)) == 3
    assert _scaling(1, 4, standby=1).warm_wanted(FakeGroup(world_size=4)) == 1


def test_a_group_below_min_waits_for_workers_warming_up() -> None:
    policy = _scaling(2, 3)
    assert policy.wait_for_warming(FakeGroup(world_size=1, warm_ready=0, warm_starting=1))
    assert not policy.wait_for_warming(FakeGroup(world_size=1, warm_ready=1, warm_starting=1))  # enough now
    assert not policy.wait_for_warming(FakeGroup(world_size=1, warm_ready=0, warm_starting=0))  # nothing to wait for


def test_new_workers_are_started_only_to_reach_min() -> None:
    policy = _scaling(2, 4)
    assert policy.new_workers_wanted(survivors=2, standbys=0) == 0  # trains on; the rest warm up meanwhile
    assert policy.new_workers_wanted(survivors=1, standbys=0) == 3
    assert policy.new_workers_wanted(survivors=0, standbys=1) == 3


def test_resize_to_what_is_available_else_wait_then_give_up() -> None:
    policy = _scaling(2, 3)
    assert policy.decide(available=5, waited_s=0, reason="lost") == FormGroup(3)
    assert policy.decide(available=2, waited_s=0, reason="lost") == FormGroup(2)
    assert policy.decide(available=1, waited_s=59, reason="lost") == WaitForCapacity()
    assert policy.decide(available=1, waited_s=61, reason="lost rank 1") == GiveUp(
        "lost rank 1; only 1 of workers.min 2 can be placed"
    )


def test_the_first_group_forms_at_most_max_of_the_workers_started_and_none_below_min() -> None:
    policy = _scaling(2, 3)
    assert policy.formation(available=4) == FormGroup(3)
    assert policy.formation(available=2) == FormGroup(2)
    assert policy.formation(available=1) is None  # Starting fails: too few workers started
