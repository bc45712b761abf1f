"""`ringmaster queue`: the queued jobs in the order the dispatcher will start them, why each waits, and each tenant's
fair-share standing, through the REST API (GET /v1/queue); `ringmaster drain`: a node's drain, which makes room
elsewhere for the jobs on it (POST /v1/nodes/{id}/drain)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from ringmaster.cli.failures import _handled
from ringmaster.cli.jobs import ApiOption, _client
from ringmaster.cli.render import console
from ringmaster.service.planner import format_duration

MAX_LIMIT = 1000  # GET /v1/queue's own limit


@_handled
def queue(
    tenant: Annotated[
        str | None, typer.Option(help="Only this tenant's jobs (positions stay the whole queue's).")
    ] = None,
    limit: Annotated[
        int, typer.Option(min=1, max=MAX_LIMIT, help="Show at most this many jobs, from the front.")
    ] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of tables.")] = False,
    api: ApiOption = None,
) -> None:
    """The queue in plan order with why each job waits, and each tenant's weight and share of the cluster."""
    answer = _client(api).queue(tenant=tenant, limit=limit)
    if as_json:
        print(json.dumps(answer, indent=2))
        return
    _print_queue(answer, datetime.now(UTC))


@_handled
def drain(
    node_id: Annotated[str, typer.Argument(help="The node's Ray id (hex), as `ray list nodes` shows it.")],
    deadline_s: Annotated[
        float | None, typer.Option(min=0, help="Seconds until the node goes; default: no deadline.")
    ] = None,
    reason: Annotated[str | None, typer.Option(help="Why, as Ray records it.")] = None,
    api: ApiOption = None,
) -> None:
    """Drain a node before it goes (an admin's): nothing new is placed there, and its jobs move off it, each saved at
    a step boundary and resumed elsewhere."""
    answer = _client(api).drain_node(node_id, deadline_s, reason)
    by = f" by {answer['deadline']}" if answer["deadline"] else ""
    console.print(f"node {answer['node_id']} drains{by}: its jobs move off it")


def _print_queue(answer: dict[str, Any], now: datetime) -> None:
    items = answer["items"]
    if items:
        table = Table("#", "job", "tenant", "prio", "workers", "waiting", "why", title="Queue (plan order)")
        for job in items:
            table.add_row(
                "-" if job["position"] is None else str(job["position"]),
                f"{job['id'][:12]} {escape(job['name'])}",
                escape(job["tenant"]),
                str(job["priority"]),
                _workers_text(job["workers"]),
                format_duration(max((now - datetime.fromisoformat(job["queued_since"])).total_seconds(), 0.0)),
                escape(_why(job)),
            )
        console.print(table)
    else:
        console.print("the queue is empty")
    if answer["total"] > len(items):
        console.print(f"{len(items)} of {answer['total']} queued jobs shown (--limit)")
    if answer["tenants"]:
        console.print(_tenants_table(answer["tenants"]))


def _workers_text(workers: dict[str, Any]) -> str:
    """'2-4 × 1 GPU', '2 × 0.5 CPU': the sizes the job accepts and what each worker holds."""
    sizes = str(workers["min"]) if workers["min"] == workers["max"] else f"{workers['min']}-{workers['max']}"
    each = f"{workers['gpus_per_worker']} GPU" if workers["gpus_per_worker"] else f"{workers['cpus_per_worker']:g} CPU"
    return f"{sizes} × {each}"


def _why(job: dict[str, Any]) -> str:
    reason = job["waiting_reason"] or "not planned yet"
    if job["preemptions"]:
        preempted_for = f" for {job['preempted_for'][:12]}" if job["preempted_for"] else ""
        reason += f" (preempted {job['preemptions']}×{preempted_for})"
    return str(reason)


def _tenants_table(standing: list[dict[str, Any]]) -> Table:
    table = Table("tenant", "weight", "share now", "decayed", "entitled", "held", title="Tenants (fair share)")
    for tenant in standing:
        table.add_row(
            escape(tenant["name"]),
            f"{tenant['weight']:g}",
            f"{tenant['share']:.1%}",
            f"{tenant['decayed_share']:.1%}",
            f"{tenant['entitled_share']:.1%}",
            f"{tenant['held_gpus']} GPU, {tenant['held_cpus']:g} CPU",
        )
    return table
