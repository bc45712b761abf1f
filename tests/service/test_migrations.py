"""The Alembic history builds exactly the schema the models describe, on both databases."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from ringmaster.service.db import alembic_config, make_engine, upgrade_schema
from ringmaster.service.models import Base

TABLES = {
    "jobs",
    "job_events",
    "attempts",
    "metrics",
    "checkpoints",
    "memory_measurements",
    "tenants",
    "api_tokens",
    "code_archives",
    "mlflow_runs",
    "tenant_shares",
}


def test_upgrade_matches_the_models_exactly(db_url: str) -> None:
    upgrade_schema(db_url)
    upgrade_schema(db_url)  # a second replica starting later finds nothing to do
    engine = make_engine(db_url)
    try:
        with engine.connect() as connection:
            assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
            assert set(inspect(connection).get_table_names()) == TABLES | {"alembic_version"}
            head = ScriptDirectory.from_config(alembic_config(connection)).get_current_head()
            assert MigrationContext.configure(connection).get_current_revision() == head
    finally:
        engine.dispose()


def test_downgrade_to_base_removes_every_table(db_url: str) -> None:
    upgrade_schema(db_url)
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            command.downgrade(alembic_config(connection), "base")
        with engine.connect() as connection:
            assert set(inspect(connection).get_table_names()) == {"alembic_version"}
    finally:
        engine.dispose()


def test_downgrading_the_scheduler_drops_its_columns_and_table_and_upgrade_restores_them(db_url: str) -> None:
    upgrade_schema(db_url)
    engine = make_engine(db_url)
    scheduling_columns = {"queue_position", "preempted_for", "preempt_requested_at", "preemptions"}
    try:
        with engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0010")
        with engine.connect() as connection:
            assert not scheduling_columns & {column["name"] for column in inspect(connection).get_columns("jobs")}
            assert "weight" not in {column["name"] for column in inspect(connection).get_columns("tenants")}
            assert "tenant_shares" not in inspect(connection).get_table_names()
        upgrade_schema(db_url)
        with engine.connect() as connection:
            assert scheduling_columns <= {column["name"] for column in inspect(connection).get_columns("jobs")}
            assert "tenant_shares" in inspect(connection).get_table_names()
    finally:
        engine.dispose()


def test_downgrade_one_revision_drops_the_user_metrics_column_and_upgrade_restores_it(db_url: str) -> None:
    upgrade_schema(db_url)
    engine = make_engine(db_url)
    try:
        with engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0009")
        with engine.connect() as connection:
            assert "user_metrics" not in {column["name"] for column in inspect(connection).get_columns("metrics")}
        upgrade_schema(db_url)
        with engine.connect() as connection:
            assert "user_metrics" in {column["name"] for column in inspect(connection).get_columns("metrics")}
    finally:
        engine.dispose()


def test_downgrading_the_listing_indexes_restores_the_earlier_ones_and_upgrade_brings_them_back(db_url: str) -> None:
    upgrade_schema(db_url)
    engine = make_engine(db_url)
    listing = {"ix_jobs_newest", "ix_jobs_state", "ix_jobs_tenant_state", "ix_jobs_queue_order"}

    def indexes(table: str) -> set[str | None]:
        with engine.connect() as connection:
            return {index["name"] for index in inspect(connection).get_indexes(table)}

    try:
        with engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0011")
        assert not listing & indexes("jobs") and {"ix_jobs_created_at", "ix_jobs_tenant"} <= indexes("jobs")
        assert "ix_tenant_shares_tenant" not in indexes("tenant_shares")
        upgrade_schema(db_url)
        assert listing | {"ix_jobs_tenant"} <= indexes("jobs") and "ix_jobs_created_at" not in indexes("jobs")
        assert "ix_tenant_shares_tenant" in indexes("tenant_shares")
    finally:
        engine.dispose()


def test_downgrading_the_dispatch_index_drops_it_and_upgrade_brings_it_back(db_url: str) -> None:
    upgrade_schema(db_url)
    engine = make_engine(db_url)

    def indexes() -> set[str | None]:
        with engine.connect() as connection:
            return {index["name"] for index in inspect(connection).get_indexes("jobs")}

    try:
        with engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0012")
        assert "ix_jobs_dispatch" not in indexes() and "ix_jobs_queue_order" in indexes()
        upgrade_schema(db_url)
        assert "ix_jobs_dispatch" in indexes()
    finally:
        engine.dispose()
