"""Initial schema: jobs, job_events, attempts, metrics, checkpoints.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _utc() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("admitted_at", _utc(), nullable=True),
        sa.Column("started_at", _utc(), nullable=True),
        sa.Column("finished_at", _utc(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("submission_id", sa.String(length=255), nullable=True),
        sa.Column("lease_owner", sa.String(length=255), nullable=True),
        sa.Column("lease_expires_at", _utc(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
    )
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])
    op.create_index("ix_jobs_queue", "jobs", ["state", sa.text("priority DESC"), "created_at"])

    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("at", _utc(), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=True),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("data", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_job_events_job_id_jobs"),
        sa.PrimaryKeyConstraint("id", name="pk_job_events"),
    )
    op.create_index("ix_job_events_job_id", "job_events", ["job_id"])

    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("submission_id", sa.String(length=255), nullable=False),
        sa.Column("placement_group", sa.String(length=255), nullable=True),
        sa.Column("world_size", sa.Integer(), nullable=True),
        sa.Column("started_at", _utc(), nullable=False),
        sa.Column("ended_at", _utc(), nullable=True),
        sa.Column("outcome", sa.String(length=32), nullable=True),
        sa.Column("last_report_seq", sa.Integer(), nullable=False, server_default="0"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_attempts_job_id_jobs"),
        sa.PrimaryKeyConstraint("id", name="pk_attempts"),
        sa.UniqueConstraint("job_id", "number", name="uq_attempts_job_id_number"),
        sa.UniqueConstraint("submission_id", name="uq_attempts_submission_id"),
    )

    op.create_table(
        "metrics",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("val_loss", sa.Float(), nullable=True),
        sa.Column("samples_per_s", sa.Float(), nullable=True),
        sa.Column("step_time_s", sa.Float(), nullable=True),
        sa.Column("wall_time", sa.Float(), nullable=True),
        sa.Column("lr", sa.Float(), nullable=True),
        sa.Column("world_size", sa.Integer(), nullable=True),
        sa.Column("recorded_at", _utc(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_metrics_job_id_jobs"),
        sa.PrimaryKeyConstraint("id", name="pk_metrics"),
        sa.UniqueConstraint("job_id", "attempt", "step", name="uq_metrics_job_id_attempt_step"),
    )

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("uri", sa.String(length=1024), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("final", sa.Boolean(), nullable=False),
        sa.Column("created_at", _utc(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_checkpoints_job_id_jobs"),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoints"),
        sa.UniqueConstraint("job_id", "uri", name="uq_checkpoints_job_id_uri"),
    )


def downgrade() -> None:
    op.drop_table("checkpoints")
    op.drop_table("metrics")
    op.drop_table("attempts")
    op.drop_index("ix_job_events_job_id", table_name="job_events")
    op.drop_table("job_events")
    op.drop_index("ix_jobs_queue", table_name="jobs")
    op.drop_index("ix_jobs_created_at", table_name="jobs")
    op.drop_table("jobs")
