"""A script job's outcome policy: a lost worker restarts the group, a rank's failure fails the job naming the first
to fail, every rank's exit 0 succeeds, anything else goes on."""

from __future__ import annotations

from dataclasses import dataclass

from ringmaster.workers.driver.script_policy import (
    AllSucceeded,
    FailScript,
    KeepRunning,
    RankExit,
    RestartGroup,
    ScriptOutcomePolicy,
)


@dataclass
class _Lost:
    rank: int
    node_id: str


def _exit(rank: int, code: int, at: float = 0.0, stopped: bool = False, tail: tuple[str, ...] = ()) -> RankExit:
    ended = {
        "code": code,
        "at": at,
        "stopped": stopped,
        "description": f"exited with code {code}",
        "start_error": None,
    }
    return RankExit.of(rank, f"node-{rank}-0123456789abcdef", 100 + rank, ended, list(tail))


def test_every_rank_exiting_zero_succeeds_and_until_then_it_keeps_running() -> None:
    policy = ScriptOutcomePolicy()
    assert policy.decide(2, [], {0: _exit(0, 0)}) == KeepRunning()
    assert policy.decide(2, [], {0: _exit(0, 0), 1: _exit(1, 0)}) == AllSucceeded()


def test_a_lost_worker_restarts_the_group_even_when_its_peers_failed_for_it() -> None:
    decision = ScriptOutcomePolicy().decide(2, [_Lost(1, "abcdef0123456789")], {0: _exit(0, 1)})
    assert decision == RestartGroup("lost rank(s) [1] on node(s) ['abcdef012345']")


def test_the_first_rank_to_fail_is_named_with_its_code_and_stderr() -> None:
    exits = {0: _exit(0, 143, at=2.0), 1: _exit(1, 3, at=1.0, tail=("Traceback …", "ValueError: no data"))}
    decision = ScriptOutcomePolicy().decide(2, [], exits)
    assert decision == FailScript(
        "rank 1 exited with code 3 (node node-1-01234, pid 101); the last lines of its stderr:\n"
        "Traceback …\nValueError: no data"
    )


def test_a_rank_stopped_on_request_is_no_failure() -> None:
    assert ScriptOutcomePolicy().decide(2, [], {0: _exit(0, -15, stopped=True)}) == KeepRunning()
