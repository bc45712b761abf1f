"""Administration directly in the database (RINGMASTER_DATABASE_URL), not through the API: the schema (`db upgrade`),
API tokens (`token create/list/revoke`) and tenants with their quotas (`tenant create/quota/list`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich.table import Table

from ringmaster.cli.failures import _fail
from ringmaster.cli.render import _held, _quota_text, console
from ringmaster.service.settings import get_settings

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

_Number = TypeVar("_Number", int, float)


def db_upgrade() -> None:
    """Bring the database schema to the newest version."""
    from ringmaster.service.db import upgrade_schema

    url = get_settings().resolved_database_url()
    upgrade_schema(url)
    console.print(f"schema is up to date at {url}")


@contextmanager
def _database_session() -> Iterator[Session]:
    """One transaction on the settings' database, its schema brought up to date first."""
    from ringmaster.service.db import Database, session_scope, upgrade_schema

    url = get_settings().resolved_database_url()
    upgrade_schema(url)
    database = Database.connect(url)
    try:
        with session_scope(database.sessions) as session:
            yield session
    finally:
        database.dispose()


def token_create(
    tenant: Annotated[
        str, typer.Option("--tenant", help="The tenant the token speaks for; created without quotas when missing.")
    ],
    admin: Annotated[
        bool, typer.Option("--admin", help="See and manage every tenant's jobs, tenants and tokens.")
    ] = False,
    description: Annotated[str | None, typer.Option(help="Who or what holds it.")] = None,
) -> None:
    """Make a token and print it once: only its hash is stored."""
    from ringmaster.service import auth, tenants

    try:
        with _database_session() as session:
            issued = auth.create_token(session, tenant, admin=admin, description=description)
            token_id = issued.row.id
    except (tenants.InvalidTenant, ValueError) as error:
        _fail(str(error))
    if issued.tenant_created:
        console.print(
            f"created tenant {tenant!r} without quotas (set them with `ringmaster tenant quota {tenant}`)",
            soft_wrap=True,
        )
    console.print(
        f"token {token_id} for tenant {tenant!r}{' (admin)' if admin else ''}; it is shown only now:", soft_wrap=True
    )
    print(issued.secret)


def token_list(tenant: Annotated[str | None, typer.Option(help="Only this tenant's tokens.")] = None) -> None:
    """Every token (never its secret)."""
    from ringmaster.service import auth

    with _database_session() as session:
        rows = [
            (
                str(t.id),
                t.tenant,
                "yes" if t.admin else "",
                t.description or "",
                f"{t.created_at:%Y-%m-%d %H:%M:%S}",
                f"{t.revoked_at:%Y-%m-%d %H:%M:%S}" if t.revoked_at else "",
            )
            for t in auth.list_tokens(session, tenant)
        ]
    table = Table("id", "tenant", "admin", "description", "created", "revoked")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def token_revoke(
    token_id: Annotated[int, typer.Argument(help="The token's id, from `ringmaster token list`.")],
) -> None:
    """Refuse the token from the next request on."""
    from ringmaster.service import auth

    try:
        with _database_session() as session:
            auth.revoke_token(session, token_id)
    except auth.TokenNotFound as error:
        _fail(str(error))
    console.print(f"token {token_id} revoked")


def _quota_value(text: str | None, kind: type[_Number], flag: str) -> _Number | None:
    """A quota option: a number >= 0, or 'unlimited'."""
    if text is None or text.strip().lower() in ("unlimited", "none"):
        return None
    try:
        value = kind(text)
    except ValueError:
        raise typer.BadParameter(f"{flag} takes a number >= 0 or 'unlimited', got {text!r}") from None
    if value < 0:
        raise typer.BadParameter(f"{flag} takes a number >= 0 or 'unlimited', got {text!r}")
    return value


GpusOption = Annotated[
    str | None, typer.Option("--gpus", help="GPUs its admitted jobs may hold at once, or 'unlimited'.")
]
CpusOption = Annotated[
    str | None, typer.Option("--cpus", help="CPUs its admitted jobs may hold at once, or 'unlimited'.")
]
JobsOption = Annotated[
    str | None, typer.Option("--jobs", help="Jobs it may have admitted or running at once, or 'unlimited'.")
]
WeightOption = Annotated[
    float | None,
    typer.Option(
        "--weight",
        help="Its weight in fair share (above 0, at most 1000; 1 unless set): among jobs of equal priority, "
        "capacity goes to the tenant furthest below its weighted share of the cluster.",
    ),
]


def tenant_create(
    name: str,
    gpus: GpusOption = None,
    cpus: CpusOption = None,
    jobs: JobsOption = None,
    weight: WeightOption = None,
) -> None:
    """Add a tenant; an omitted quota is unlimited, an omitted weight 1."""
    from ringmaster.service import tenants
    from ringmaster.service.models import Tenant

    quota = tenants.Quota(
        _quota_value(gpus, int, "--gpus"), _quota_value(cpus, float, "--cpus"), _quota_value(jobs, int, "--jobs")
    )
    try:
        with _database_session() as session:
            if session.get(Tenant, name) is not None:
                _fail(f"tenant {name!r} exists; change its quotas with `ringmaster tenant quota {name}`")
            row, _ = tenants.put_tenant(session, name, quota, weight=weight)
            shown_weight = row.weight
    except tenants.InvalidTenant as error:
        _fail(str(error))
    console.print(f"tenant {name!r}: {_quota_text(quota)}, weight {shown_weight:g}")


def tenant_quota(
    name: str,
    gpus: GpusOption = None,
    cpus: CpusOption = None,
    jobs: JobsOption = None,
    weight: WeightOption = None,
) -> None:
    """Change the quotas (a number, or 'unlimited') and the fair-share weight given; the others stay as they are."""
    from ringmaster.service import tenants

    try:
        with _database_session() as session:
            current = tenants.Quota.of(tenants.get_tenant(session, name))
            quota = tenants.Quota(
                current.gpus if gpus is None else _quota_value(gpus, int, "--gpus"),
                current.cpus if cpus is None else _quota_value(cpus, float, "--cpus"),
                current.jobs if jobs is None else _quota_value(jobs, int, "--jobs"),
            )
            row, _ = tenants.put_tenant(session, name, quota, weight=weight)
            shown_weight = row.weight
    except (tenants.TenantNotFound, tenants.InvalidTenant) as error:
        _fail(str(error))
    console.print(f"tenant {name!r}: {_quota_text(quota)}, weight {shown_weight:g}")


def tenant_list() -> None:
    """Every tenant with its quotas and what its jobs hold now."""
    from ringmaster.service import tenants

    table = Table("tenant", "GPUs", "CPUs", "jobs", "weight")
    with _database_session() as session:
        for tenant in tenants.list_tenants(session):
            quota, used = tenants.Quota.of(tenant), tenants.usage(session, tenant.name)
            table.add_row(
                tenant.name,
                _held(used.gpus, quota.gpus),
                _held(used.cpus, quota.cpus),
                _held(used.jobs, quota.jobs),
                f"{tenant.weight:g}",
            )
    console.print(table)
