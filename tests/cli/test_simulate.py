"""`ringmaster simulate` and `ringmaster simulate-trace` on the repository's small trace: the table with ratios to
the first policy, the JSON's structure, the PNG, and every bad input as one line with exit code 1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ringmaster.cli.app import app

SMALL_TRACE = Path(__file__).resolve().parents[2] / "examples" / "traces" / "small.csv"
CLUSTER = ["--nodes", "2", "--gpus-per-node", "4"]
runner = CliRunner()


def _simulate(*arguments: str) -> tuple[int, str]:
    result = runner.invoke(app, ["simulate", "--trace", str(SMALL_TRACE), *CLUSTER, *arguments])
    return result.exit_code, result.output


def test_the_table_shows_every_policy_and_its_ratios_to_the_first() -> None:
    code, output = _simulate("--policy", "fifo", "--policy", "elastic", "--policy", "las")
    assert code == 0, output
    assert "40 jobs (ringmaster format)" in output
    assert "ratios against fifo" in output
    for label in ("JCT mean", "JCT p99", "wait p95", "longest wait", "makespan", "GPU utilization", "Jain's index"):
        assert label in output
    assert "×)" in output


def test_json_has_every_figure_ratio_and_timeline_per_policy() -> None:
    code, output = _simulate("--policy", "fifo", "--policy", "backfill", "--json", "--setting", "shrink_s=1")
    assert code == 0, output
    document = json.loads(output)
    assert document["trace"] == {"path": str(SMALL_TRACE), "format": "ringmaster", "jobs": 40, "unusable": {}}
    assert document["cluster"]["gpus"] == 8
    assert document["settings"]["shrink_s"] == 1.0
    assert document["baseline"] == "fifo"
    assert list(document["policies"]) == ["fifo", "backfill"]
    fifo, backfill = document["policies"]["fifo"], document["policies"]["backfill"]
    assert fifo["metrics"]["jobs"] == 40
    assert fifo["ratio_to_baseline"]["jct_mean_s"] == 1.0
    assert backfill["ratio_to_baseline"]["jct_mean_s"] == pytest.approx(
        backfill["metrics"]["jct_mean_s"] / fifo["metrics"]["jct_mean_s"]
    )
    assert len(fifo["timeline"]) == 200
    assert all(0.0 <= point["gpu_utilization"] <= 1.0 + 1e-9 for point in fifo["timeline"])


def test_plot_writes_a_png(tmp_path: Path) -> None:
    picture = tmp_path / "run.png"
    code, output = _simulate("--policy", "fifo", "--policy", "elastic", "--plot", str(picture))
    assert code == 0, output
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_trace_writes_a_trace_the_simulator_reads(tmp_path: Path) -> None:
    out = tmp_path / "synthetic.csv"
    result = runner.invoke(app, ["simulate-trace", str(out), "--jobs", "30", "--seed", "4", "--sizes", "1:3,2:1"])
    assert result.exit_code == 0, result.output
    again = tmp_path / "again.csv"
    runner.invoke(app, ["simulate-trace", str(again), "--jobs", "30", "--seed", "4", "--sizes", "1:3,2:1"])
    assert out.read_text() == again.read_text()
    result = runner.invoke(app, ["simulate", "--trace", str(out), *CLUSTER, "--policy", "fair", "--json"])
    assert json.loads(result.output)["policies"]["fair"]["metrics"]["jobs"] == 30


def _one_line_error(arguments: list[str]) -> str:
    result = runner.invoke(app, arguments)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


def _malformed(tmp_path: Path) -> str:
    path = tmp_path / "bad.csv"
    path.write_text("job_id,submit_time,duration,gpus\nx,0,ten,1\n")
    return str(path)


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--trace", "/nonexistent/trace.csv", *CLUSTER, "--policy", "fifo"], "no trace at /nonexistent/trace.csv"),
        (["--trace", str(SMALL_TRACE), *CLUSTER, "--policy", "sjf"], "unknown policy 'sjf'; the policies are fifo"),
        (["--trace", str(SMALL_TRACE), *CLUSTER, "--policy", "fifo", "--setting", "speed=2"], "unknown setting"),
        (["--trace", str(SMALL_TRACE), *CLUSTER, "--policy", "fifo", "--setting", "grow_s=x"], "takes a number"),
        (["--trace", str(SMALL_TRACE), "--nodes", "0", "--gpus-per-node", "4", "--policy", "fifo"], "≥ 1 node"),
        (["--trace", "MALFORMED", *CLUSTER, "--policy", "fifo"], "bad.csv line 2: duration is not a number"),
        (["--trace", str(SMALL_TRACE), *CLUSTER, "--policy", "fifo", "--plot", "/nonexistent/p.png"], "no folder"),
    ],
)
def test_bad_input_is_one_line(tmp_path: Path, arguments: list[str], expected: str) -> None:
    arguments = [_malformed(tmp_path) if argument == "MALFORMED" else argument for argument in arguments]
    assert expected in _one_line_error(["simulate", *arguments])


def test_a_trace_with_nothing_usable_says_why(tmp_path: Path) -> None:
    path = tmp_path / "large.csv"
    path.write_text("job_id,submit_time,duration,gpus\nx,0,60,64\ny,0,,1\n")
    line = _one_line_error(["simulate", "--trace", str(path), *CLUSTER, "--policy", "fifo"])
    assert "has no job the simulator can use (1 larger than the cluster, 1 no duration)" in line


def test_a_bad_synthetic_shape_is_one_line(tmp_path: Path) -> None:
    line = _one_line_error(["simulate-trace", str(tmp_path / "t.csv"), "--sizes", "big"])
    assert "sizes are GPUS:WEIGHT" in line


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what a missing package does to an import
    arguments = [
        "simulate",
        "--trace",
        str(SMALL_TRACE),
        *CLUSTER,
        "--policy",
        "fifo",
        "--plot",
        str(tmp_path / "p.png"),
    ]
    assert "pip install 'ringmaster[simulate]'" in _one_line_error(arguments)
    assert not (tmp_path / "p.png").exists()
