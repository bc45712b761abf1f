"""A script's metric points, read as their files grow: ringmaster.report's JSON lines, and the scalars of the
TensorBoard event files it writes (torch's SummaryWriter here), whose tags name the metrics ringmaster keeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringmaster.workers.script.metric_sources import ReportedMetrics, TensorBoardScalars
from ringmaster.workers.script.report import METRICS_FILE_VARIABLE, report


def test_reported_points_are_read_once_each_with_the_scripts_own_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv(METRICS_FILE_VARIABLE, str(path))
    source = ReportedMetrics(str(path))
    assert source.read() == []
    report(0, loss=2.5, accuracy=0.5, **{"no spaces": 1.0})
    report(1, loss=2.0, lr=0.1)
    points = source.read()
    assert [{k: v for k, v in point.items() if k != "wall_time"} for point in points] == [
        {"step": 0, "loss": 2.5, "user_metrics": {"accuracy": 0.5}},
        {"step": 1, "loss": 2.0, "lr": 0.1},
    ]
    assert "ringmaster.report: 'no spaces' ignored: a metric name is a letter" in capsys.readouterr().err
    with path.open("a") as file:
        file.write('{"step": 2, "loss"')  # a line still being written
    assert source.read() == []


def test_tensorboard_scalars_are_read_as_the_file_grows(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "run"))
    source = TensorBoardScalars(str(tmp_path))
    writer.add_scalar("train/loss", 1.5, 10)
    writer.add_scalar("train/learning_rate", 0.01, 10)
    writer.add_scalar("train/epoch", 0.1, 10)  # not a metric ringmaster keeps
    writer.flush()
    [point] = source.read()
    assert point["step"] == 10 and point["loss"] == pytest.approx(1.5) and point["lr"] == pytest.approx(0.01)
    assert set(point) == {"step", "wall_time", "loss", "lr"}
    writer.add_scalar("eval/loss", 1.25, 20)
    writer.flush()
    [later] = source.read()
    assert later["step"] == 20 and later["val_loss"] == pytest.approx(1.25)
    writer.close()


def test_tensorboard_text_beside_the_scalars_is_skipped(tmp_path: Path) -> None:
    """A Hugging Face Trainer writes its arguments as text before its first step, and a script may tag text as a
    metric: the read that met either raised (a string is no float), and every point its loader had taken was lost."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    writer.add_text("args", '{"learning_rate": 5e-05}')
    writer.add_text("train/loss", "not a number", 1)
    writer.add_scalar("train/loss", 1.5, 1)
    writer.close()
    [point] = TensorBoardScalars(str(tmp_path)).read()
    assert point["step"] == 1 and point["loss"] == pytest.approx(1.5)
