"""Listing indexes: GET /v1/jobs in its exact order (newest first, then id) for each filter it takes (state, tenant,
both), the queue view in its plan order, and each tenant's newest share sample.

With 100,000 jobs a page filtered by state sorted every matching row, and a deep page by offset read every row before
it; the queue view sorted every queued row, and its tenants' standing scanned the week of share samples
(bench/control_plane_scale.py).

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.sql.elements import ColumnElement, TextClause

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_NEWEST: Sequence[str | TextClause | ColumnElement[object]] = [sa.text("created_at DESC"), "id"]


def upgrade() -> None:
    op.drop_index("ix_jobs_created_at", table_name="jobs")
    op.drop_index("ix_jobs_tenant", table_name="jobs")
    op.create_index("ix_jobs_newest", "jobs", _NEWEST)
    op.create_index("ix_jobs_state", "jobs", ["state", *_NEWEST])
    op.create_index("ix_jobs_tenant", "jobs", ["tenant", *_NEWEST])
    op.create_index("ix_jobs_tenant_state", "jobs", ["tenant", "state", *_NEWEST])
    op.create_index(
        "ix_jobs_queue_order", "jobs", ["state", "queue_position", sa.text("priority DESC"), "created_at", "id"]
    )
    op.create_index("ix_tenant_shares_tenant", "tenant_shares", ["tenant", "at", "id"])


def downgrade() -> None:
    op.drop_index("ix_tenant_shares_tenant", table_name="tenant_shares")
    op.drop_index("ix_jobs_queue_order", table_name="jobs")
    op.drop_index("ix_jobs_tenant_state", table_name="jobs")
    op.drop_index("ix_jobs_tenant", table_name="jobs")
    op.drop_index("ix_jobs_state", table_name="jobs")
    op.drop_index("ix_jobs_newest", table_name="jobs")
    op.create_index("ix_jobs_tenant", "jobs", ["tenant", "created_at"])
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])
