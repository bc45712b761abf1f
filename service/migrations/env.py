"""Alembic environment: runs on the connection service.db.upgrade_schema hands it."""

from __future__ import annotations

from alembic import context

from ringmaster.service.models import Base

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through service.db.upgrade_schema(url), which supplies the connection")

context.configure(connection=connection, target_metadata=Base.metadata)
with context.begin_transaction():
    context.run_migrations()
