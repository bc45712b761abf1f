"""The dispatcher's index: every pass reads the id and attempt of each queued job, and of each active one with whether
it was asked to stop, to learn which jobs changed since its last pass. From (state, id, attempt,
preempt_requested_at) alone those reads touch no table row (with 10,000 queued jobs, SQLite fetched every row, its
spec beside it, from the table).

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_dispatch", "jobs", ["state", "id", "attempt", "preempt_requested_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_dispatch", table_name="jobs")
