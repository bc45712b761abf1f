"""What the control plane hands each attempt's job driver: its report secret and its JobSpec. Shared by both sides.

Neither travels where Ray shows it: a Ray job's runtime_env and entrypoint are in the dashboard's Jobs API, and a worker
actor's environment in its tasks. The dispatcher's Ray agent puts the handoff in the cluster's GCS key-value store
under the attempt's submission id before submitting its Ray job; the driver takes it (reads and deletes it) once it
has joined the cluster. Every attempt has a secret of its own, so a handoff is taken once, and one that no driver
took is dropped when its attempt is closed.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel, ConfigDict, SecretStr, ValidationError, field_serializer

from ringmaster.service.spec import JobSpec

HANDOFF_NAMESPACE = "ringmaster"  # the GCS key-value store's namespace: apart from Ray's own keys


def handoff_key(submission_id: str) -> str:
    """Where an attempt's handoff waits for its driver: one key per attempt, as its submission id is."""
    return f"driver-handoff/{submission_id}"


class DriverHandoff(BaseModel):
    """One attempt's handoff. Its repr and str hide the secret, so no log line or traceback shows it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    report_token: SecretStr
    spec: JobSpec

    @field_serializer("report_token", when_used="json")
    def _reveal_for_the_driver(self, token: SecretStr) -> str:
        return token.get_secret_value()

    def to_json(self) -> str:
        """The handoff as the GCS stores it, secret included."""
        return self.model_dump_json()


class HandoffStore(Protocol):
    """A key-value store both sides reach: Ray's GCS (service/ray_internals.RayInternalKv); a dict in tests."""

    def put(self, namespace: str, key: str, value: bytes) -> None: ...
    def get(self, namespace: str, key: str) -> bytes | None: ...
    def delete(self, namespace: str, key: str) -> bool: ...


class HandoffMissing(RuntimeError):
    """No handoff waits for this attempt: its driver took it already, or the attempt was closed."""


class HandoffUnreadable(ValueError):
    """A handoff this version cannot read; its message names the fields, never their values (the secret is one)."""


def put(store: HandoffStore, submission_id: str, handoff_json: str) -> None:
    """Leave an attempt's handoff (DriverHandoff.to_json) for its driver, before its Ray job is submitted."""
    store.put(HANDOFF_NAMESPACE, handoff_key(submission_id), handoff_json.encode())


def take(store: HandoffStore, submission_id: str) -> DriverHandoff:
    """The attempt's handoff, removed from the store: the driver that takes it is the only one to read it."""
    key = handoff_key(submission_id)
    raw = store.get(HANDOFF_NAMESPACE, key)
    if raw is None or not store.delete(HANDOFF_NAMESPACE, key):
        raise HandoffMissing(
            f"no handoff for Ray job {submission_id} in the cluster's key-value store: another driver took it, or the "
            "control plane closed this attempt"
        )
    try:
        return DriverHandoff.model_validate_json(raw)
    except ValidationError as error:  # its own message quotes the input: the secret would reach the driver's log
        problems = "; ".join(
            f"{'.'.join(map(str, problem['loc'])) or 'the handoff'}: {problem['msg']}"
            for problem in error.errors(include_input=False, include_url=False)
        )
        raise HandoffUnreadable(f"the handoff for Ray job {submission_id} is unreadable: {problems}") from None


def drop(store: HandoffStore, submission_id: str) -> None:
    """Remove a handoff no driver took (its Ray job never started, or could not be submitted)."""
    store.delete(HANDOFF_NAMESPACE, handoff_key(submission_id))
