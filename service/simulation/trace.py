"""Workload traces: ringmaster's own CSV (one job a row) and the public Helios `cluster_log.csv`, read into the jobs a
simulation replays. Rows the simulator cannot use are counted by cause, never dropped silently."""

from __future__ import annotations

import csv
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from ringmaster.service.simulation.errors import SimulationInputError

REQUIRED_COLUMNS = ("job_id", "submit_time", "duration", "gpus")
OPTIONAL_COLUMNS = ("tenant", "priority", "min_gpus", "preemptible")
HELIOS_COLUMNS = ("job_id", "vc", "gpu_num", "submit_time")  # what a Helios row must have; duration may come from times
DEFAULT_TENANT = "default"

# Why a row cannot be replayed; each is counted and reported.
NO_DURATION = "no duration"
ZERO_GPUS = "zero GPUs"
LARGER_THAN_CLUSTER = "larger than the cluster"

_TRUE = {"true", "yes", "1", "y", "t"}
_FALSE = {"false", "no", "0", "n", "f"}


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job of a workload: when it arrives, how long it runs at its requested size, and how it may be scheduled."""

    job_id: str
    submit_time: float  # seconds from the trace's start
    duration: float  # seconds of running at `gpus` workers
    gpus: int  # the requested size: workers of one GPU each
    tenant: str = DEFAULT_TENANT
    priority: int = 0
    min_gpus: int | None = None  # the elastic lower bound; None: not elastic
    preemptible: bool = True

    @property
    def elastic(self) -> bool:
        return self.min_gpus is not None and self.min_gpus < self.gpus


@dataclass(frozen=True, slots=True)
class TraceReading:
    """The usable jobs of a trace in submit order, and how many rows were left out for each cause."""

    jobs: tuple[TraceJob, ...]
    unusable: dict[str, int] = field(default_factory=dict)
    trace_format: str = "ringmaster"


def read_trace(path: Path, cluster_gpus: int) -> TraceReading:
    """Read a ringmaster or Helios trace; jobs asking for more than `cluster_gpus` GPUs are counted, not replayed."""
    try:
        with path.open(newline="", encoding="utf-8") as stream:
            return read_trace_rows(csv.DictReader(stream), cluster_gpus, path.name)
    except FileNotFoundError:
        raise SimulationInputError(f"no trace at {path}") from None
    except IsADirectoryError:
        raise SimulationInputError(f"{path} is a directory, not a trace") from None
    except UnicodeDecodeError:
        raise SimulationInputError(f"{path} is not a text CSV file") from None


def read_trace_rows(reader: csv.DictReader[str], cluster_gpus: int, source: str) -> TraceReading:
    """Read rows from a CSV reader whose header names the format: Helios when it has `vc` and `gpu_num`."""
    header = [name.strip() for name in (reader.fieldnames or [])]
    if not header:
        raise SimulationInputError(f"{source}: empty trace, expected a header line")
    reader.fieldnames = header
    if "gpu_num" in header and "vc" in header:
        trace_format, parse = "helios", _helios_job
        required: tuple[str, ...] = HELIOS_COLUMNS
    else:
        trace_format, parse = "ringmaster", _ringmaster_job
        required = REQUIRED_COLUMNS
    missing = [name for name in required if name not in header]
    if missing:
        raise SimulationInputError(
            f"{source}: the header lacks {', '.join(missing)} (a trace has {', '.join(REQUIRED_COLUMNS)}, "
            f"optionally {', '.join(OPTIONAL_COLUMNS)}; or is a Helios cluster_log.csv)"
        )
    jobs: list[TraceJob] = []
    unusable: Counter[str] = Counter()
    for line, row in _numbered(reader):
        if None in row:
            raise SimulationInputError(f"{source} line {line}: more fields than the header has")
        job_or_cause = parse(row, f"{source} line {line}")
        if isinstance(job_or_cause, str):
            unusable[job_or_cause] += 1
        elif job_or_cause.gpus > cluster_gpus:
            unusable[LARGER_THAN_CLUSTER] += 1
        else:
            jobs.append(job_or_cause)
    _check_unique_ids(jobs, source)
    if trace_format == "helios" and jobs:
        start = min(job.submit_time for job in jobs)
        jobs = [_shifted(job, -start) for job in jobs]
    jobs.sort(key=lambda job: job.submit_time)
    return TraceReading(tuple(jobs), dict(unusable), trace_format)


def write_trace(jobs: Iterable[TraceJob], path: Path) -> None:
    """Write jobs in ringmaster's trace format, every optional column included."""
    with path.open("w", newline="", encoding="utf-8") as stream:
        writer = csv.writer(stream)
        writer.writerow((*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS))
        for job in jobs:
            writer.writerow(
                (
                    job.job_id,
                    _number_text(job.submit_time),
                    _number_text(job.duration),
                    job.gpus,
                    job.tenant,
                    job.priority,
                    "" if job.min_gpus is None else job.min_gpus,
                    "true" if job.preemptible else "false",
                )
            )


def _numbered(reader: csv.DictReader[str]) -> Iterator[tuple[int, dict[str | None, str | None]]]:
    for row in reader:
        yield reader.line_num, row


def _ringmaster_job(row: dict[str | None, str | None], where: str) -> TraceJob | str:
    duration = _optional_float(row, "duration", where)
    gpus = _int(row, "gpus", where)
    usable = _usable_duration(duration, gpus)
    if isinstance(usable, str):
        return usable
    min_gpus = _optional_int(row, "min_gpus", where)
    if min_gpus is not None and not 1 <= min_gpus <= gpus:
        raise SimulationInputError(f"{where}: min_gpus {min_gpus} must be between 1 and gpus ({gpus})")
    submit_time = _optional_float(row, "submit_time", where)
    if submit_time is None:
        raise SimulationInputError(f"{where}: submit_time is empty")
    return TraceJob(
        job_id=_text(row, "job_id", where),
        submit_time=submit_time,
        duration=usable,
        gpus=gpus,
        tenant=(row.get("tenant") or "").strip() or DEFAULT_TENANT,
        priority=_optional_int(row, "priority", where) or 0,
        min_gpus=min_gpus,
        preemptible=_bool(row, "preemptible", where),
    )


def _usable_duration(duration: float | None, gpus: int) -> float | str:
    """A row's duration where either format's row can be simulated, else the name of the cause it cannot."""
    if duration is None or duration <= 0:
        return NO_DURATION
    if gpus <= 0:
        return ZERO_GPUS
    return duration


def _helios_job(row: dict[str | None, str | None], where: str) -> TraceJob | str:
    """A Helios row: `vc` is the tenant; the duration is its own column, else end_time − start_time; never elastic."""
    gpus = _int(row, "gpu_num", where)
    duration = _optional_float(row, "duration", where) if row.get("duration") else None
    if duration is None:
        start, end = _optional_time(row, "start_time", where), _optional_time(row, "end_time", where)
        duration = end - start if start is not None and end is not None else None
    usable = _usable_duration(duration, gpus)
    if isinstance(usable, str):
        return usable
    submit_time = _optional_time(row, "submit_time", where)
    if submit_time is None:
        raise SimulationInputError(f"{where}: submit_time is empty")
    return TraceJob(
        job_id=_text(row, "job_id", where),
        submit_time=submit_time,
        duration=usable,
        gpus=gpus,
        tenant=(row.get("vc") or "").strip() or DEFAULT_TENANT,
    )


def _shifted(job: TraceJob, seconds: float) -> TraceJob:
    return TraceJob(
        job.job_id,
        job.submit_time + seconds,
        job.duration,
        job.gpus,
        job.tenant,
        job.priority,
        job.min_gpus,
        job.preemptible,
    )


def _check_unique_ids(jobs: list[TraceJob], source: str) -> None:
    seen: set[str] = set()
    for job in jobs:
        if job.job_id in seen:
            raise SimulationInputError(f"{source}: job_id {job.job_id!r} appears twice")
        seen.add(job.job_id)


def _text(row: dict[str | None, str | None], column: str, where: str) -> str:
    value = (row.get(column) or "").strip()
    if not value:
        raise SimulationInputError(f"{where}: {column} is empty")
    return value


def _optional_float(row: dict[str | None, str | None], column: str, where: str) -> float | None:
    value = (row.get(column) or "").strip()
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        raise SimulationInputError(f"{where}: {column} is not a number: {value!r}") from None
    if not math.isfinite(number):
        raise SimulationInputError(f"{where}: {column} is not a finite number: {value!r}")
    return number


def _optional_int(row: dict[str | None, str | None], column: str, where: str) -> int | None:
    number = _optional_float(row, column, where)
    if number is None:
        return None
    if number != int(number):
        raise SimulationInputError(f"{where}: {column} is not a whole number: {row.get(column)!r}")
    return int(number)


def _int(row: dict[str | None, str | None], column: str, where: str) -> int:
    number = _optional_int(row, column, where)
    if number is None:
        raise SimulationInputError(f"{where}: {column} is empty")
    return number


def _optional_time(row: dict[str | None, str | None], column: str, where: str) -> float | None:
    """Seconds, or a date and time as Helios writes them (2020-04-01 00:00:09, read as UTC), as seconds since the
    epoch."""
    value = (row.get(column) or "").strip()
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise SimulationInputError(f"{where}: {column} is neither seconds nor a date and time: {value!r}") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _bool(row: dict[str | None, str | None], column: str, where: str) -> bool:
    value = (row.get(column) or "").strip().lower()
    if not value or value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SimulationInputError(f"{where}: {column} is not true or false: {row.get(column)!r}")


def _number_text(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(round(value, 3))
