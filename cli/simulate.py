"""`ringmaster simulate`: replay a workload trace on a simulated cluster through the scheduler's own plan function,
for several policies at once, each figure beside its ratio to the first policy's; `ringmaster simulate-trace`
writes a synthetic trace."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from ringmaster.cli.failures import _fail
from ringmaster.cli.render import console
from ringmaster.service.planner import format_duration
from ringmaster.service.scheduling.model import PolicyName
from ringmaster.service.scheduling.plan import plan
from ringmaster.service.simulation.engine import ClusterShape, PlanViolation, Simulation, SimulationRun
from ringmaster.service.simulation.errors import SimulationInputError
from ringmaster.service.simulation.generator import DEFAULT_SIZE_WEIGHTS, PRESETS, WorkloadShape, generate
from ringmaster.service.simulation.metrics import PolicyMetrics, measure, ratios, utilization_timeline
from ringmaster.service.simulation.settings import SimulationSettings, parse_settings
from ringmaster.service.simulation.trace import TraceReading, read_trace, write_trace

TIMELINE_POINTS = 200  # per policy in --json: time-weighted means over equal spans of the run
PLOT_POINTS = 1000
_DEFAULT_SIZES = ",".join(f"{size}:{weight:g}" for size, weight in DEFAULT_SIZE_WEIGHTS)

# The table's rows: (label, field, how to show it)
_ROWS: tuple[tuple[str, str, str], ...] = (
    ("JCT mean", "jct_mean_s", "duration"),
    ("JCT median", "jct_median_s", "duration"),
    ("JCT p95", "jct_p95_s", "duration"),
    ("JCT p99", "jct_p99_s", "duration"),
    ("wait mean", "wait_mean_s", "duration"),
    ("wait median", "wait_median_s", "duration"),
    ("wait p95", "wait_p95_s", "duration"),
    ("wait p99", "wait_p99_s", "duration"),
    ("longest wait", "longest_wait_s", "duration"),
    ("makespan", "makespan_s", "duration"),
    ("GPU utilization", "gpu_utilization", "percent"),
    ("preemptions/job", "preemptions_per_job", "number"),
    ("resizes/job", "resizes_per_job", "number"),
    ("GPU-hours lost", "lost_gpu_hours", "number"),
    ("Jain's index (tenants)", "jain_index", "number"),
    ("worst ρ (JCT/alone)", "worst_finish_time_fairness", "number"),
    ("plan CPU ms median", "decision_cpu_ms_median", "milliseconds"),
    ("plan CPU ms max", "decision_cpu_ms_max", "milliseconds"),
    ("passes", "passes", "count"),
    ("most queued at a pass", "most_queued_at_a_pass", "count"),
)


def simulate(
    trace: Annotated[Path, typer.Option("--trace", help="The workload: ringmaster's CSV or a Helios cluster_log.csv.")],
    nodes: Annotated[int, typer.Option("--nodes", help="Nodes in the simulated cluster.")],
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="GPUs on each node.")],
    policy: Annotated[
        list[str],
        typer.Option("--policy", help="fifo, backfill, fair, elastic or las; repeatable, the first is the baseline."),
    ],
    cpus_per_node: Annotated[float, typer.Option("--cpus-per-node", help="CPUs on each node.")] = 0.0,
    setting: Annotated[
        list[str] | None,
        typer.Option("--setting", help="NAME=VALUE over a default (docs/operations/simulate.md); repeatable."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print every figure as JSON instead of a table.")] = False,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Write GPU utilization and queue length over time to a PNG.")
    ] = None,
) -> None:
    """Replay a trace on a simulated cluster through the scheduler's plan, per policy: JCT, waits, utilization,
    fairness, and the plan's time per pass."""
    try:
        policies = _policies(policy)
        settings = parse_settings(setting or [])
        cluster = ClusterShape(nodes, gpus_per_node, cpus_per_node)
        reading = read_trace(trace, cluster.gpus)
        if not reading.jobs:
            _fail(f"{trace} has no job the simulator can use ({_unusable_text(reading) or 'no rows'})")
        if plot is not None:
            _check_plotting(plot)
        runs = _run_all(reading, cluster, settings, policies, quiet=as_json)
    except (SimulationInputError, PlanViolation) as error:
        _fail(str(error))
    results = {name: measure(run) for name, run in runs.items()}
    if as_json:
        document = _document(trace, reading, cluster, settings, runs, results)
        typer.echo(json.dumps(document, indent=2))
    else:
        _print_summary(trace, reading, cluster, results)
    if plot is not None:
        _plot(runs, plot)
        if not as_json:
            console.print(f"wrote {plot}")


def simulate_trace(
    out: Annotated[Path, typer.Argument(help="The CSV file to write.")],
    preset: Annotated[
        str | None,
        typer.Option(help="helios: sizes, durations and load from the Helios trace's published figures."),
    ] = None,
    cluster_gpus: Annotated[
        int, typer.Option(help="With --preset: the GPUs of the cluster the preset's arrival rate loads as its trace.")
    ] = 64,
    jobs: Annotated[int, typer.Option("--jobs", help="How many jobs.")] = 1000,
    seed: Annotated[int, typer.Option("--seed", help="The random seed: the same seed writes the same trace.")] = 0,
    arrivals_per_hour: Annotated[
        float | None, typer.Option(help="Mean arrivals per hour (a Poisson process); 60 without a preset.")
    ] = None,
    sizes: Annotated[str | None, typer.Option(help=f"GPUS:WEIGHT,… the job sizes' distribution; {_DEFAULT_SIZES}.")] = (
        None
    ),
    duration_median_s: Annotated[
        float | None, typer.Option(help="Median duration (log-normal), seconds; 1800.")
    ] = None,
    duration_sigma: Annotated[
        float | None, typer.Option(help="The log-normal's sigma, the durations' spread; 1.5.")
    ] = (None),
    tenants: Annotated[str, typer.Option(help="Tenant names, comma-separated; each job's drawn uniformly.")] = (
        "team-a,team-b"
    ),
    elastic_share: Annotated[float, typer.Option(help="Share of jobs of ≥ 2 GPUs elastic down to half.")] = 0.5,
    high_priority_share: Annotated[float, typer.Option(help="Share of jobs at priority 1 (the rest at 0).")] = 0.1,
) -> None:
    """Write a synthetic trace in ringmaster's format for `ringmaster simulate`; an option given beside --preset
    overrides the preset's value."""
    try:
        if preset is None:
            shape = WorkloadShape(jobs=jobs, seed=seed)
        elif preset.strip().lower() in PRESETS:
            if cluster_gpus < 1:
                raise SimulationInputError(f"--cluster-gpus is at least 1, got {cluster_gpus}")
            shape = PRESETS[preset.strip().lower()](cluster_gpus, jobs, seed)
        else:
            raise SimulationInputError(f"unknown preset {preset!r}; the presets are {', '.join(PRESETS)}")
        given: dict[str, Any] = {
            "arrivals_per_hour": arrivals_per_hour,
            "size_weights": _size_weights(sizes) if sizes is not None else None,
            "duration_median_s": duration_median_s,
            "duration_sigma": duration_sigma,
        }
        shape = dataclasses.replace(
            shape,
            tenants=tuple(name.strip() for name in tenants.split(",")),
            elastic_share=elastic_share,
            high_priority_share=high_priority_share,
            **{name: value for name, value in given.items() if value is not None},
        )
        write_trace(generate(shape), out)
    except SimulationInputError as error:
        _fail(str(error))
    except OSError as error:
        _fail(f"cannot write {out}: {error.strerror}")
    console.print(f"wrote {jobs} jobs to {out} ({shape.arrivals_per_hour:.4g} arrivals an hour)")


def _policies(names: list[str]) -> list[PolicyName]:
    known = ", ".join(str(name) for name in PolicyName)
    policies = []
    for name in names:
        try:
            policies.append(PolicyName(name.strip().lower()))
        except ValueError:
            raise SimulationInputError(f"unknown policy {name!r}; the policies are {known}") from None
    if len(set(policies)) != len(policies):
        raise SimulationInputError("a policy is named twice")
    return policies


def _size_weights(text: str) -> tuple[tuple[int, float], ...]:
    pairs = []
    for item in text.split(","):
        size, separator, weight = item.partition(":")
        try:
            pairs.append((int(size), float(weight)))
        except ValueError:
            raise SimulationInputError(f"sizes are GPUS:WEIGHT,…, got {text!r}") from None
        if not separator:
            raise SimulationInputError(f"sizes are GPUS:WEIGHT,…, got {text!r}")
    return tuple(pairs)


def _run_all(
    reading: TraceReading,
    cluster: ClusterShape,
    settings: SimulationSettings,
    policies: list[PolicyName],
    quiet: bool,
) -> dict[PolicyName, SimulationRun]:
    """Each policy in turn on the same jobs, with a progress bar of jobs finished per policy (on stderr)."""
    runs = {}
    columns = (TextColumn("{task.description:>9}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=quiet) as progress:
        for name in policies:
            task = progress.add_task(str(name), total=len(reading.jobs))

            def advance(finished: int, task_id: TaskID = task) -> None:
                progress.update(task_id, completed=finished)

            runs[name] = Simulation(reading.jobs, cluster, settings, name, plan, advance).run()
            progress.update(task, completed=len(reading.jobs))
    return runs


def _unusable_text(reading: TraceReading) -> str:
    return ", ".join(f"{count} {cause}" for cause, count in sorted(reading.unusable.items()))


def _print_summary(
    trace: Path, reading: TraceReading, cluster: ClusterShape, results: dict[PolicyName, PolicyMetrics]
) -> None:
    left_out = _unusable_text(reading)
    console.print(
        f"{trace}: {len(reading.jobs)} jobs ({reading.trace_format} format)"
        + (f", left out: {left_out}" if left_out else "")
        + f"; cluster {cluster.nodes} × {cluster.gpus_per_node} GPUs",
        soft_wrap=True,
    )
    names = list(results)
    baseline = results[names[0]]
    table = Table(title=f"ratios against {names[0]}" if len(names) > 1 else None)
    table.add_column("figure")
    for name in names:
        table.add_column(str(name), justify="right")
    relative = {name: ratios(metrics, baseline) for name, metrics in results.items()}
    for label, field, kind in _ROWS:
        cells = []
        for index, name in enumerate(names):
            text = _cell(getattr(results[name], field), kind)
            ratio = relative[name][field]
            if index and ratio is not None and kind != "count":
                text += f" ({ratio:.2f}×)"
            cells.append(text)
        table.add_row(label, *cells)
    console.print(table)


def _cell(value: float, kind: str) -> str:
    if kind == "duration":
        return _duration(value)
    if kind == "percent":
        return f"{value:.1%}"
    if kind == "milliseconds":
        return f"{value:.2f}"
    if kind == "count":
        return str(int(value))
    return f"{value:.3g}" if value else "0"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 48 * 3600:
        return format_duration(seconds)
    return f"{seconds / 86400:.1f}d"


def _document(
    trace: Path,
    reading: TraceReading,
    cluster: ClusterShape,
    settings: SimulationSettings,
    runs: dict[PolicyName, SimulationRun],
    results: dict[PolicyName, PolicyMetrics],
) -> dict[str, Any]:
    baseline_name = next(iter(results))
    return {
        "trace": {
            "path": str(trace),
            "format": reading.trace_format,
            "jobs": len(reading.jobs),
            "unusable": reading.unusable,
        },
        "cluster": {
            "nodes": cluster.nodes,
            "gpus_per_node": cluster.gpus_per_node,
            "cpus_per_node": cluster.cpus_per_node,
            "gpus": cluster.gpus,
        },
        "settings": settings.as_dict(),
        "baseline": str(baseline_name),
        "policies": {
            str(name): {
                "metrics": metrics.as_dict(),
                "ratio_to_baseline": ratios(metrics, results[baseline_name]),
                "timeline": [
                    {"t": at, "gpu_utilization": held, "queued": queued}
                    for at, held, queued in utilization_timeline(runs[name], TIMELINE_POINTS)
                ],
            }
            for name, metrics in results.items()
        },
    }


def _check_plotting(path: Path) -> None:
    """Before minutes of simulation: matplotlib is there, and so is the folder the picture goes in."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _fail("--plot needs matplotlib: pip install 'ringmaster[simulate]'")
    if not path.parent.is_dir():
        _fail(f"cannot write {path}: no folder {path.parent}")


def _plot(runs: dict[PolicyName, SimulationRun], path: Path) -> None:
    """Two charts sharing a time axis in hours: the share of GPUs held, and the jobs queued, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (held_axes, queue_axes) = pyplot.subplots(2, 1, sharex=True, figsize=(10, 6), constrained_layout=True)
    for name, run in runs.items():
        timeline = utilization_timeline(run, PLOT_POINTS)
        start = timeline[0][0] if timeline else 0.0
        hours = [(at - start) / 3600.0 for at, _, _ in timeline]
        held_axes.plot(hours, [held * 100.0 for _, held, _ in timeline], label=str(name), linewidth=1)
        queue_axes.plot(hours, [queued for _, _, queued in timeline], label=str(name), linewidth=1)
    held_axes.set_ylabel("GPUs held (%)")
    held_axes.set_ylim(0, 105)
    held_axes.legend(loc="lower right")
    queue_axes.set_ylabel("jobs queued")
    queue_axes.set_xlabel("hours since the first submit")
    try:
        figure.savefig(path, dpi=100)
    except OSError as error:
        _fail(f"cannot write {path}: {error.strerror}")
    finally:
        pyplot.close(figure)
