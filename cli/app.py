"""The `ringmaster` command: one typer app with its commands in the order `ringmaster --help` lists them, and the
db, token and tenant groups of admin.py's commands."""

from __future__ import annotations

import typer

from ringmaster.cli import admin, jobs, local, planning, queue, simulate

app = typer.Typer(help="ringmaster: elastic distributed training as a service.", no_args_is_help=True)
db_app = typer.Typer(help="Database administration.", no_args_is_help=True)
token_app = typer.Typer(
    help="API tokens, made and revoked directly in the database (RINGMASTER_DATABASE_URL).", no_args_is_help=True
)
tenant_app = typer.Typer(
    help="Tenants and their quotas, directly in the database (RINGMASTER_DATABASE_URL).", no_args_is_help=True
)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")
app.add_typer(tenant_app, name="tenant")

app.command()(local.serve)
app.command()(local.stop)
app.command()(jobs.submit)
app.command()(jobs.status)
app.command()(queue.queue)
app.command()(queue.drain)
app.command()(jobs.watch)
app.command()(jobs.logs)
app.command()(jobs.cancel)
app.command()(jobs.tensorboard)
app.command()(jobs.export)
app.command()(planning.plan)
app.command()(simulate.simulate)
app.command("simulate-trace")(simulate.simulate_trace)
app.command()(local.demo)

db_app.command("upgrade")(admin.db_upgrade)
token_app.command("create")(admin.token_create)
token_app.command("list")(admin.token_list)
token_app.command("revoke")(admin.token_revoke)
tenant_app.command("create")(admin.tenant_create)
tenant_app.command("quota")(admin.tenant_quota)
tenant_app.command("list")(admin.tenant_list)
