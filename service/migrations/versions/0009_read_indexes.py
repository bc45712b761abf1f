"""Read indexes: a job's validated metric rows, its rows in stored order, and the attempts still open.

Reads repeated all the time then no longer go through every row there is: a job's newest validation (at every status
request) and the MLflow export's next rows after its cursor, among every step the job ran; the open attempts (at every
dispatcher pass), among every attempt ever run.

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
_OPEN = sa.text("ended_at IS NULL")


def upgrade() -> None:
    op.create_index("ix_metrics_validated", "metrics", ["job_id", "attempt", "step"], sqlite_where=_VALIDATED,
                    postgresql_where=_VALIDATED)
    op.create_index("ix_metrics_job_id_id", "metrics", ["job_id", "id"])
    op.create_index("ix_attempts_open", "attempts", ["id"], sqlite_where=_OPEN, postgresql_where=_OPEN)


def downgrade() -> None:
    op.drop_index("ix_attempts_open", table_name="attempts")
    op.drop_index("ix_metrics_job_id_id", table_name="metrics")
    op.drop_index("ix_metrics_validated", table_name="metrics")
