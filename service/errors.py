"""Domain errors raised by the control plane; api/errors.py maps each to one HTTP status."""

from __future__ import annotations

from typing import Any

# The 422 error types of rules that no JSON Schema can state, so a request the OpenAPI schema allows may still break
# them; each names its field. Every other rule of a request is in the schema.
VALUE_CONFLICT = "value_conflict"  # a rule between fields: one divides another, needs another, excludes another
DOES_NOT_FIT = "does_not_fit"  # the cluster's nodes or GPUs cannot hold the job
QUOTA_EXCEEDED = "quota_exceeded"  # the tenant's quota cannot hold the job, even alone
UNKNOWN_REFERENCE = "unknown_reference"  # a job, code archive or model class that does not exist here
RULES_BEYOND_SCHEMA = (VALUE_CONFLICT, DOES_NOT_FIT, QUOTA_EXCEEDED, UNKNOWN_REFERENCE)


class RingmasterError(Exception):
    """Base of the errors a caller is expected to handle."""


class JobNotFound(RingmasterError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job with id {job_id!r}")
        self.job_id = job_id


class JobConflict(RingmasterError):
    """The request is valid but the job's current state forbids it (e.g. cancelling a finished job)."""


class InvalidSpec(RingmasterError):
    """A job spec that failed to parse or validate; ``errors`` are pydantic-style entries (type, loc, msg)."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("; ".join(str(error["msg"]) for error in errors))
        self.errors = errors


class LogsUnavailable(RingmasterError):
    """No logs can be served now: no provider configured, or the cluster cannot be reached."""


class PlanError(RingmasterError):
    """Planner input that cannot be planned (unknown model, bad size options); ``field`` names the input at fault and
    ``kind`` is the 422's error type (VALUE_CONFLICT for a rule between fields)."""

    def __init__(self, message: str, field: str, kind: str = "value_error") -> None:
        super().__init__(message)
        self.field, self.kind = field, kind


class CodeTooLarge(RingmasterError):
    """A code archive (or what it unpacks to) over RINGMASTER_MAX_CODE_BYTES."""

    def __init__(self, what: str, size: int, limit: int, hint: str = "") -> None:
        super().__init__(f"{what} is {size} bytes, over the limit of {limit} bytes (RINGMASTER_MAX_CODE_BYTES){hint}")
        self.size, self.limit = size, limit


class InvalidCode(RingmasterError):
    """An upload that is not a code archive ringmaster can hand Ray: not a zip, an unsafe path inside, nothing in it."""


class CodeNotFound(RingmasterError):
    """No code archive of this hash for the tenant (another tenant's is not found either)."""

    def __init__(self, ref: str, tenant: str) -> None:
        super().__init__(
            f"no code archive {ref[:80]} for tenant {tenant!r}: upload it first (POST /v1/code, "
            "or `ringmaster submit --code DIR`)"
        )
        self.ref = ref


class NodeNotFound(RingmasterError):
    """No live node of the cluster has the id asked about."""


class DrainRefused(RingmasterError):
    """Ray would not drain the node (the head node, say)."""


class ClusterUnavailable(RingmasterError):
    """What was asked needs the cluster, which this server has none of or cannot reach now."""
