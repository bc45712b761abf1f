"""How the command line shows things: its console, the states' colours, a job's details, the fields `watch` shows, the
plan's table and the tenants' quotas."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ringmaster.service.planner import GB, format_bytes, format_duration

console = Console()


_STATE_STYLE = {
    "SUCCEEDED": "green",
    "FAILED": "red",
    "CANCELLED": "yellow",
    "RUNNING": "cyan",
    "ADMITTED": "blue",
    "QUEUED": "white",
}


def _trimmed(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _loss_text(loss: float) -> str:
    """Four decimals as losses usually read; four significant digits where that would print a diverging loss's 30
    digits, or 0.0000 for a tiny one."""
    return f"{loss:.4f}" if loss == 0 or 1e-3 <= abs(loss) < 1e6 else f"{loss:.4g}"


def _print_job(job: dict[str, Any]) -> None:
    style = _STATE_STYLE.get(job["state"], "white")
    progress = job["progress"]
    console.print(
        f"job [bold]{job['id']}[/bold] {escape(job['name'])}: [{style}]{job['state']}[/{style}] "
        f"(attempt {job['attempt']}, tenant {escape(job['tenant'])})",
        soft_wrap=True,
    )
    of_total = "" if progress["total_steps"] is None else f"/{progress['total_steps']}"  # None: a script job
    parts = [f"step {progress['step']}{of_total}"]
    if progress["loss"] is not None:
        parts.append(f"loss {_loss_text(progress['loss'])}")
    if progress["val_loss"] is not None:
        parts.append(f"val loss {_loss_text(progress['val_loss'])} (step {progress['val_step']})")
    if progress["world_size"] is not None:
        parts.append(f"world size {progress['world_size']}")
    parts.append(f"recoveries {progress['recoveries']}")
    if progress["eta_s"] is not None:
        parts.append(f"ETA {format_duration(progress['eta_s'])}")
    # Unwrapped: a line cut at the terminal's width would split a value (a timestamp) in two.
    console.print("  ".join(parts), soft_wrap=True)
    times = [
        f"{label} {job[field][:19].replace('T', ' ')}"
        for label, field in (("created", "created_at"), ("started", "started_at"), ("finished", "finished_at"))
        if job.get(field)
    ]
    console.print("  ".join(times), soft_wrap=True)
    if job.get("waiting_reason"):
        console.print(f"waiting: {escape(job['waiting_reason'])}", soft_wrap=True)
    if job.get("error"):
        console.print(f"error: {escape(job['error'])}", soft_wrap=True)
    if job.get("dashboard_url"):
        console.print(f"Ray dashboard: {job['dashboard_url']}", soft_wrap=True)


def _shown(state: str | None, new_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What a progress message changes of the watched fields: state, step (`completed`), loss, val_loss, speed."""
    shown: dict[str, Any] = {"state": state} if state else {}
    for row in new_rows:
        if row.get("loss") is not None:
            shown.update(
                completed=row["step"], loss=_loss_text(row["loss"]), speed=f"{row.get('samples_per_s') or 0:.1f}"
            )
        if row.get("val_loss") is not None:
            shown.update(val_loss=_loss_text(row["val_loss"]))
    return shown


def _print_plan(result: dict[str, Any]) -> None:
    console.print(f"[bold]{result['model']}[/bold]: {result['parameters']:,} parameters", soft_wrap=True)
    console.print(f"precision {result['precision']}: {result['precision_note']}", soft_wrap=True)
    console.print(
        f"cluster: {result['nodes']} × {result['gpus_per_node']} = {result['world_size']} GPUs, "
        f"{result['gpu_memory_gb']:g} GB each"
    )
    table = Table(
        "option",
        "state/GPU",
        "activations",
        "total/GPU",
        "fits",
        "traffic/step",
        "bubble",
        caption="traffic: bytes each GPU sends per step (one micro-batch per replica, m through a pipeline); "
        "? needs the transformer's shape and --micro-batch-size",
    )
    chosen = (result["recommendation"] or {}).get("label")
    for option in result["options"]:
        memory, traffic = option["memory_per_gpu"], option["communication_per_step"]
        fits = {True: "[green]yes[/green]", False: "[red]no[/red]", None: "?"}[option["fits"]]
        state = memory["parameters_gb"] + memory["gradients_gb"] + memory["optimizer_gb"]
        table.add_row(
            f"[bold]{option['label']} ★[/bold]" if option["label"] == chosen else option["label"],
            _gb(state),
            _gb(memory["activations_gb"]),
            _gb(memory["total_gb"]),
            fits,
            _gb(traffic["total_gb"]),
            f"{option['bubble_fraction']} = {option['bubble']:.1%}" if option["bubble"] is not None else "-",
        )
    console.print(table)
    console.print(f"recommended: [bold]{chosen}[/bold]" if chosen else "[red]nothing fits[/red]")
    for reason in result["reasons"] + ((result["recommendation"] or {}).get("reasons") or []):
        console.print(f"  - {reason}", soft_wrap=True)


def _gb(value: float | None) -> str:
    return "?" if value is None else format_bytes(value * GB)


def _held(used: float, limit: float | None) -> str:
    return f"{used:g} / {'unlimited' if limit is None else f'{limit:g}'}"


def _quota_text(quota: Any) -> str:
    return ", ".join(
        f"{resource} {'unlimited' if value is None else f'{value:g}'}"
        for resource, value in (("GPUs", quota.gpus), ("CPUs", quota.cpus), ("jobs", quota.jobs))
    )
