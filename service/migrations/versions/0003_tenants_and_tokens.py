"""Tenants with quotas, hashed API tokens, each job's tenant and waiting reason, per-attempt report tokens.

Existing jobs move to the "default" tenant. Attempts admitted before this revision have no report token,
so their drivers' reports are refused; the reconciler resubmits such a job once its Ray job ends.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

DEFAULT_TENANT = "default"


def _utc() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    tenants = op.create_table(
        "tenants",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("quota_gpus", sa.Integer(), nullable=True),
        sa.Column("quota_cpus", sa.Float(), nullable=True),
        sa.Column("quota_jobs", sa.Integer(), nullable=True),
        sa.Column("created_at", _utc(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_tenants"),
    )
    now = datetime.now(UTC)
    if op.get_bind().dialect.name == "sqlite":
        now = now.replace(tzinfo=None)  # stored as naive UTC, as service.models.UTCDateTime does
    op.bulk_insert(tenants, [{"name": DEFAULT_TENANT, "quota_gpus": None, "quota_cpus": None, "quota_jobs": None, "created_at": now}])

    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("description", sa.String(length=255), nullable=True),
        sa.Column("created_at", _utc(), nullable=False),
        sa.Column("revoked_at", _utc(), nullable=True),
        sa.ForeignKeyConstraint(["tenant"], ["tenants.name"], name="fk_api_tokens_tenant_tenants"),
        sa.PrimaryKeyConstraint("id", name="pk_api_tokens"),
        sa.UniqueConstraint("token_hash", name="uq_api_tokens_token_hash"),
    )
    op.create_index("ix_api_tokens_tenant", "api_tokens", ["tenant"])

    # NOT NULL with a server default fills existing rows; SQLite can add it without rebuilding the table.
    op.add_column("jobs", sa.Column("tenant", sa.String(length=64), server_default=DEFAULT_TENANT, nullable=False))
    op.add_column("jobs", sa.Column("waiting_reason", sa.Text(), nullable=True))
    op.create_index("ix_jobs_tenant", "jobs", ["tenant", "created_at"])

    op.add_column("attempts", sa.Column("report_token_hash", sa.String(length=64), nullable=True))
    op.add_column("attempts", sa.Column("max_workers", sa.Integer(), nullable=True))


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite >= 3.35): rebuilding jobs would trip the foreign keys that point at it.
    op.drop_column("attempts", "max_workers")
    op.drop_column("attempts", "report_token_hash")
    op.drop_index("ix_jobs_tenant", table_name="jobs")
    op.drop_column("jobs", "waiting_reason")
    op.drop_column("jobs", "tenant")
    op.drop_index("ix_api_tokens_tenant", table_name="api_tokens")
    op.drop_table("api_tokens")
    op.drop_table("tenants")
