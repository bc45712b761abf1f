"""Job states and the one table of legal transitions."""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "QUEUED"
    ADMITTED = "ADMITTED"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    # Stopped to make room for a job of higher priority (or a fairer share): its attempt is being closed, and it goes
    # back to QUEUED in its old place, resuming from what it saved. Not a failure: max_failures is untouched.
    PREEMPTED = "PREEMPTED"


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE = frozenset({JobState.ADMITTED, JobState.RUNNING, JobState.RECOVERING})

_ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.ADMITTED, JobState.CANCELLED, JobState.FAILED}),
    JobState.ADMITTED: frozenset(
        {JobState.RUNNING, JobState.QUEUED, JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED}
    ),
    # QUEUED from a live state: the attempt was lost outside the driver's control and is retried.
    JobState.RUNNING: frozenset(
        {
            JobState.RECOVERING,
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.CANCELLED,
            JobState.QUEUED,
            JobState.PREEMPTED,
        }
    ),
    JobState.RECOVERING: frozenset(
        {JobState.RUNNING, JobState.FAILED, JobState.CANCELLED, JobState.QUEUED, JobState.PREEMPTED}
    ),
    JobState.PREEMPTED: frozenset({JobState.QUEUED, JobState.CANCELLED, JobState.FAILED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class IllegalTransition(ValueError):
    def __init__(self, current: JobState, target: JobState) -> None:
        super().__init__(f"job cannot go from {current} to {target}")
        self.current, self.target = current, target


def check_transition(current: JobState, target: JobState) -> None:
    """Raise IllegalTransition unless current → target is in the table."""
    if target not in _ALLOWED[JobState(current)]:
        raise IllegalTransition(JobState(current), JobState(target))
