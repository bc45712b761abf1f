"""Code archives: a job's own code, uploaded as a zip, content-addressed by SHA-256 within its tenant.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "code_archives",
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("unpacked_bytes", sa.BigInteger(), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["tenant"], ["tenants.name"], name="fk_code_archives_tenant_tenants"),
        sa.PrimaryKeyConstraint("tenant", "sha256", name="pk_code_archives"),
    )


def downgrade() -> None:
    op.drop_table("code_archives")
