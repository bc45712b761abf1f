"""Reading traces: ringmaster's CSV and Helios' cluster_log.csv, every unusable row counted by its cause, and a
malformed file refused in one line that says where."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ringmaster.service.simulation.errors import SimulationInputError
from ringmaster.service.simulation.trace import (
    LARGER_THAN_CLUSTER,
    NO_DURATION,
    ZERO_GPUS,
    TraceJob,
    read_trace,
    write_trace,
)

REPO_ROOT = Path(__file__).resolve().parents[3]


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def test_ringmaster_rows_with_and_without_the_optional_columns(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "job_id,submit_time,duration,gpus,tenant,priority,min_gpus,preemptible\n"
        "b,30,600,4,team-b,2,2,false\n"
        "a,0,120.5,1,,,,\n",
    )
    reading = read_trace(path, cluster_gpus=8)
    assert reading.trace_format == "ringmaster"
    assert reading.unusable == {}
    assert reading.jobs == (
        TraceJob("a", 0.0, 120.5, 1, "default", 0, None, True),
        TraceJob("b", 30.0, 600.0, 4, "team-b", 2, 2, False),
    )
    assert reading.jobs[1].elastic and not reading.jobs[0].elastic


def test_the_required_columns_alone_make_a_trace(tmp_path: Path) -> None:
    reading = read_trace(_write(tmp_path, "job_id,submit_time,duration,gpus\nx,5,60,2\n"), cluster_gpus=2)
    assert reading.jobs == (TraceJob("x", 5.0, 60.0, 2),)


def test_every_unusable_row_is_counted_by_its_cause(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "job_id,submit_time,duration,gpus\n"
        "ok,0,60,8\n"
        "no-duration,1,,2\n"
        "zero-duration,2,0,2\n"
        "zero-gpus,3,60,0\n"
        "too-large,4,60,9\n"
        "too-large-2,5,60,64\n",
    )
    reading = read_trace(path, cluster_gpus=8)
    assert [job.job_id for job in reading.jobs] == ["ok"]
    assert reading.unusable == {NO_DURATION: 2, ZERO_GPUS: 1, LARGER_THAN_CLUSTER: 2}


def test_helios_rows_take_vc_as_tenant_and_duration_from_its_column_or_the_times(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,queue\n"
        "j1,u1,vcA,8,48,1,COMPLETED,2020-04-01 00:00:10,2020-04-01 00:00:20,2020-04-01 01:00:20,3600,10\n"
        "j2,u2,vcB,2,12,1,FAILED,2020-04-01 00:01:10,2020-04-01 00:02:10,2020-04-01 00:12:10,,60\n"
        "j3,u3,vcB,0,4,1,COMPLETED,2020-04-01 00:02:00,2020-04-01 00:02:00,2020-04-01 00:03:00,60,0\n"
        "j4,u3,vcA,4,4,1,CANCELLED,2020-04-01 00:03:00,,,,\n"
        "j5,u3,vcA,16,4,2,COMPLETED,2020-04-01 00:04:00,2020-04-01 00:04:00,2020-04-01 00:05:00,60,0\n",
    )
    reading = read_trace(path, cluster_gpus=8)
    assert reading.trace_format == "helios"
    assert reading.jobs == (
        TraceJob("j1", 0.0, 3600.0, 8, "vcA"),
        TraceJob("j2", 60.0, 600.0, 2, "vcB"),
    )
    assert reading.unusable == {ZERO_GPUS: 1, NO_DURATION: 1, LARGER_THAN_CLUSTER: 1}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty trace"),
        ("job_id,submit_time,gpus\nx,0,1\n", "the header lacks duration"),
        ("job_id,submit_time,duration,gpus\nx,0,sixty,1\n", "line 2: duration is not a number: 'sixty'"),
        ("job_id,submit_time,duration,gpus\nx,0,60,1.5\n", "line 2: gpus is not a whole number"),
        ("job_id,submit_time,duration,gpus\nx,0,60,1,extra\n", "line 2: more fields than the header has"),
        ("job_id,submit_time,duration,gpus,min_gpus\nx,0,60,2,3\n", "min_gpus 3 must be between 1 and gpus (2)"),
        ("job_id,submit_time,duration,gpus,preemptible\nx,0,60,2,maybe\n", "preemptible is not true or false"),
        ("job_id,submit_time,duration,gpus\nx,0,60,1\nx,1,60,1\n", "job_id 'x' appears twice"),
        ("job_id,submit_time,duration,gpus\nx,,60,1\n", "line 2: submit_time is empty"),
    ],
)
def test_a_malformed_trace_is_refused_in_one_line_naming_the_place(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SimulationInputError, match=re.escape(message)) as raised:
        read_trace(_write(tmp_path, text), cluster_gpus=8)
    assert "\n" not in str(raised.value)


def test_a_missing_trace_is_named(tmp_path: Path) -> None:
    with pytest.raises(SimulationInputError, match=r"no trace at .*absent\.csv"):
        read_trace(tmp_path / "absent.csv", cluster_gpus=8)


def test_a_written_trace_reads_back_the_same(tmp_path: Path) -> None:
    jobs = (
        TraceJob("a", 0.0, 60.0, 1, "t1", 0, None, True),
        TraceJob("b", 1.25, 3600.5, 8, "t2", 3, 4, False),
    )
    path = tmp_path / "out.csv"
    write_trace(jobs, path)
    assert read_trace(path, cluster_gpus=8).jobs == jobs


def test_the_repository_trace_is_usable_whole_on_its_example_cluster() -> None:
    reading = read_trace(REPO_ROOT / "examples" / "traces" / "small.csv", cluster_gpus=8)
    assert len(reading.jobs) >= 24 and reading.unusable == {}
    assert {job.tenant for job in reading.jobs} == {"team-a", "team-b"}
    assert any(job.elastic for job in reading.jobs)
