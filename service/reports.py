"""What the job driver reports to the control plane. Shared by both sides; replays are idempotent."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class MetricPoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0)
    loss: float | None = None
    val_loss: float | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None
    wall_time: float | None = Field(default=None, description="Unix time at which rank 0 finished the step.")
    lr: float | None = None
    world_size: int | None = None


class CheckpointRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0)
    uri: str
    world_size: int = Field(ge=1)
    final: bool = False


class DriverReport(BaseModel):
    """One batch from the driver. ``state`` moves the job; metrics and checkpoints are upserted."""

    model_config = ConfigDict(extra="forbid")

    state: Literal["RUNNING", "SUCCEEDED", "FAILED"] | None = None
    message: str | None = Field(default=None, max_length=100_000)
    metrics: list[MetricPoint] = Field(default_factory=list, max_length=10_000)
    checkpoints: list[CheckpointRecord] = Field(default_factory=list, max_length=1000)
