"""MLflow runs: each job's run id and export cursors (RINGMASTER_MLFLOW_TRACKING_URI).

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "mlflow_runs",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=True),
        sa.Column("metric_cursor", sa.Integer(), nullable=False),
        sa.Column("checkpoint_cursor", sa.Integer(), nullable=False),
        sa.Column("finished", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_mlflow_runs_job_id_jobs"),
        sa.PrimaryKeyConstraint("job_id", name="pk_mlflow_runs"),
    )


def downgrade() -> None:
    op.drop_table("mlflow_runs")
