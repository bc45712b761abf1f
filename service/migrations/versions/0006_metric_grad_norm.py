"""Metric points carry the step's global gradient norm (train.grad_clip reports it before clipping).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("metrics", sa.Column("grad_norm", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("metrics") as batch:
        batch.drop_column("grad_norm")
