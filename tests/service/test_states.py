"""The job state machine: exactly the documented transitions are legal."""

from __future__ import annotations

from itertools import product

import pytest

from ringmaster.service.states import TERMINAL, IllegalTransition, JobState, check_transition

Q, A, R, V, S, F, C, P = (
    JobState.QUEUED,
    JobState.ADMITTED,
    JobState.RUNNING,
    JobState.RECOVERING,
    JobState.SUCCEEDED,
    JobState.FAILED,
    JobState.CANCELLED,
    JobState.PREEMPTED,
)

LEGAL = {
    (Q, A), (Q, C), (Q, F),
    (A, R), (A, Q), (A, F), (A, C), (A, P),
    (R, S), (R, F), (R, C), (R, V), (R, Q), (R, P),
    (V, R), (V, F), (V, C), (V, Q), (V, P),
    (P, Q), (P, C), (P, F),
}  # fmt: skip


@pytest.mark.parametrize(("current", "target"), list(product(JobState, JobState)), ids=lambda state: state.value)
def test_transition_is_legal_exactly_when_listed(current: JobState, target: JobState) -> None:
    if (current, target) in LEGAL:
        check_transition(current, target)
    else:
        with pytest.raises(IllegalTransition, match=f"from {current} to {target}"):
            check_transition(current, target)


def test_terminal_states_have_no_way_out() -> None:
    assert {S, F, C} == TERMINAL
    for current, target in product(TERMINAL, JobState):
        with pytest.raises(IllegalTransition):
            check_transition(current, target)
