"""Per-rank training-state memory measured by the job driver, for comparison with the planner.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "memory_measurements",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("parameter_count", sa.BigInteger(), nullable=False),
        sa.Column("parameters_bytes", sa.BigInteger(), nullable=False),
        sa.Column("gradients_bytes", sa.BigInteger(), nullable=False),
        sa.Column("optimizer_bytes", sa.BigInteger(), nullable=False),
        sa.Column("dp", sa.Integer(), nullable=False),
        sa.Column("tp", sa.Integer(), nullable=False),
        sa.Column("pp", sa.Integer(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_memory_measurements_job_id_jobs"),
        sa.PrimaryKeyConstraint("id", name="pk_memory_measurements"),
        sa.UniqueConstraint("job_id", "attempt", "rank", name="uq_memory_measurements_job_id_attempt_rank"),
    )


def downgrade() -> None:
    op.drop_table("memory_measurements")
