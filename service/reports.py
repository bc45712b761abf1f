"""What the job driver reports to the control plane. Shared by both sides; replays are idempotent.

The driver sends its attempt's report secret, which it takes from its DriverHandoff (service/driver_handoff.py), as a
bearer token with every report."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AllowInfNan, ConfigDict, Field, Strict, StringConstraints, WithJsonSchema

from ringmaster.service.json_types import JsonTyped

# The metrics of a user's own that a model's loss_fn returns beside its loss (workers/trainer/user_metrics.py): names
# that read as TensorBoard tags and MLflow keys alike, and few enough that a step's all-reduce stays small.
MAX_USER_METRICS = 32
USER_METRIC_NAME = r"^[A-Za-z][A-Za-z0-9_.\-/]{0,63}$"
# A validated step's point also holds their values over the validation set, each as val_<name> (workers/trainer/
# validator.py): twice as many, under names that may be that much longer.
VALIDATION_PREFIX = "val_"
# A script job's worker on remote storage uploads RINGMASTER_CHECKPOINT_DIR once more after its script ends, and a stop
# waits up to this long for that upload (workers/script/checkpoint_sync.py); so does the control plane before it
# stops a cancelled script job's Ray job, which would cut the upload short.
SCRIPT_FINAL_UPLOAD_WAIT_S = 120.0
_POINT_METRIC_NAME = r"^(val_)?[A-Za-z][A-Za-z0-9_.\-/]{0,63}$"
UserMetrics = Annotated[
    dict[Annotated[str, StringConstraints(pattern=_POINT_METRIC_NAME)], Annotated[float, Strict(), AllowInfNan(False)]],
    Field(max_length=2 * MAX_USER_METRICS),
    WithJsonSchema(
        {
            "type": "object",
            "maxProperties": 2 * MAX_USER_METRICS,
            "propertyNames": {"pattern": _POINT_METRIC_NAME},
            "additionalProperties": {"type": "number"},
        }
    ),
]


class MetricPoint(JsonTyped):
    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0)
    loss: float | None = None
    val_loss: float | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None
    wall_time: float | None = Field(default=None, description="Unix time at which rank 0 finished the step.")
    lr: float | None = None
    grad_norm: float | None = Field(
        default=None, description="The global gradient norm before clipping (train.grad_clip)."
    )
    world_size: int | None = None
    user_metrics: UserMetrics | None = Field(
        default=None,
        description="The step's values of the metrics the model's loss_fn returns beside its loss, by name: each the "
        "mean over the step's micro-batches and data-parallel ranks, as the loss is; where the step was validated, "
        "also each one's mean over the validation set, as val_<name> beside val_loss.",
    )
    attempt: int | None = Field(
        default=None,
        ge=1,
        description="The attempt that ran the step, when not the reporting one: a resumed attempt replays the metrics "
        "its checkpoint kept, which the attempt that wrote it may not have reported before it failed.",
    )


class StoredCheckpoint(JsonTyped):
    """A committed checkpoint on the job's storage, as its manifest describes it."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0)
    uri: str
    world_size: int | None = Field(default=None, ge=1, description="None: the manifest does not say.")
    metric: str | None = Field(default=None, max_length=32)
    metric_value: float | None = None


class CheckpointRecord(JsonTyped):
    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0)
    uri: str
    world_size: int = Field(ge=1)
    final: bool = False
    metric: str | None = Field(
        default=None, max_length=32, description="checkpoint.keep_best's metric, when the job sets one."
    )
    metric_value: float | None = Field(default=None, description="This checkpoint's value of that metric.")
    best_uri: str | None = Field(
        default=None, description="The checkpoint retention keeps as the best by the metric, after this commit."
    )
    deleted_uris: list[str] = Field(
        default_factory=list, max_length=10_000, description="Checkpoints retention deleted right after this commit."
    )
    kept: list[StoredCheckpoint] | None = Field(
        default=None,
        max_length=10_000,
        description=(
            "Every committed checkpoint on the job's storage after this commit's retention, this one included: the "
            "checkpoint rows become these, though a worker lost between its commit and its report took that record "
            "with it (None: not said)."
        ),
    )
    blocked_s: float | None = Field(
        default=None, ge=0, le=1e7, description="Seconds training waited for the save to start (staging)."
    )
    save_s: float | None = Field(default=None, ge=0, le=1e7, description="Seconds from the save's start to its commit.")


class RankMemory(JsonTyped):
    """Bytes of training state one rank holds, measured from its tensors after the first optimizer step."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(ge=0)
    parameter_count: int = Field(ge=0, description="Parameters of the whole (unsharded) model.")
    parameters_bytes: int = Field(ge=0)
    gradients_bytes: int = Field(ge=0)
    optimizer_bytes: int = Field(ge=0)
    dp: int = Field(ge=1)
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)


class DriverReport(JsonTyped):
    """One batch from the driver. ``state`` moves the job; metrics and checkpoints are upserted."""

    model_config = ConfigDict(extra="forbid")

    seq: int | None = Field(
        default=None,
        ge=1,
        description="The driver's sequence number; a report at or below the last applied one is a replay.",
    )
    state: Literal["RUNNING", "RECOVERING", "SUCCEEDED", "FAILED", "PREEMPTED"] | None = None
    message: str | None = Field(default=None, max_length=100_000)
    details: dict[str, Any] = Field(
        default_factory=dict, description="Stored on the state change's event (e.g. lost node, new world size)."
    )
    metrics: list[MetricPoint] = Field(default_factory=list, max_length=10_000)
    checkpoints: list[CheckpointRecord] = Field(default_factory=list, max_length=1000)
    memory: list[RankMemory] = Field(default_factory=list, max_length=4096)
