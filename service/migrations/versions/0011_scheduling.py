"""The scheduler across jobs: each queued job's place in the plan, preemption, and tenants' fair-share weights.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("queue_position", sa.Integer(), nullable=True))
    op.add_column("jobs", sa.Column("preempted_for", sa.String(32), nullable=True))
    op.add_column("jobs", sa.Column("preempt_requested_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("jobs", sa.Column("preemptions", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("tenants", sa.Column("weight", sa.Float(), nullable=False, server_default="1"))
    op.create_table(
        "tenant_shares",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("held_gpus", sa.Integer(), nullable=False),
        sa.Column("held_cpus", sa.Float(), nullable=False),
        sa.Column("share", sa.Float(), nullable=False),
        sa.Column("decayed_share", sa.Float(), nullable=False),
        sa.Column("entitled_share", sa.Float(), nullable=False),
    )
    op.create_index("ix_tenant_shares_at", "tenant_shares", ["at"])


def downgrade() -> None:
    op.drop_index("ix_tenant_shares_at", "tenant_shares")
    op.drop_table("tenant_shares")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("weight")
    with op.batch_alter_table("jobs") as batch:
        for column in ("preemptions", "preempt_requested_at", "preempted_for", "queue_position"):
            batch.drop_column(column)
