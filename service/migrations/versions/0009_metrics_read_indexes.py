"""Metric read indexes: a job's validated rows, and its rows in the order they were stored.

Two reads repeated while a job trains then no longer go through every step it ran: its newest validation (at every
status request), and the MLflow export's next rows after its cursor.

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
    op.create_index("ix_metrics_job_id_id", "metrics", ["job_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_metrics_job_id_id", table_name="metrics")
    op.drop_index("ix_metrics_validated", table_name="metrics")
