"""A partial index on the metric rows that carry a validation loss: a job's newest validation without a scan of
every step it ran.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_VALIDATED = sa.text("val_loss IS NOT NULL")


def upgrade() -> None:
    op.create_index("ix_metrics_validated", "metrics", ["job_id", "attempt", "step"], sqlite_where=_VALIDATED,
                    postgresql_where=_VALIDATED)


def downgrade() -> None:
    op.drop_index("ix_metrics_validated", table_name="metrics")
