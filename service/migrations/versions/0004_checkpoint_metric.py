"""Checkpoints record checkpoint.keep_best's metric, their value of it, and whether retention keeps them as the best.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("checkpoints", sa.Column("metric", sa.String(length=32), nullable=True))
    op.add_column("checkpoints", sa.Column("metric_value", sa.Float(), nullable=True))
    op.add_column("checkpoints", sa.Column("best", sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("best")
        batch.drop_column("metric_value")
        batch.drop_column("metric")
