"""The driver's TensorBoard event file, read back by tensorboard's own loader, which checks every record's CRC."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ringmaster.service.reports import MetricPoint
from ringmaster.service.spec import JobSpec
from ringmaster.workers.driver.training_log import TensorBoardEvents, TrainingLog


def _read(directory: Path) -> dict[int, dict[str, float]]:
    """Each step's scalars as TensorBoard's data loader gives them (simple values migrated to the scalars plugin's
    tensors). A record whose CRC does not match ends the loader's read of the file there."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util.tensor_util import make_ndarray

    [path] = directory.iterdir()
    steps: dict[int, dict[str, float]] = {}
    for event in EventFileLoader(str(path)).Load():
        for value in event.summary.value:
            assert value.metadata.plugin_data.plugin_name == "scalars", value
            steps.setdefault(event.step, {})[value.tag] = float(make_ndarray(value.tensor))
    return steps


def test_every_batch_of_points_is_readable_as_written_before_the_file_is_closed(tmp_path: Path) -> None:
    events = TensorBoardEvents(str(tmp_path))
    rng = np.random.default_rng(0)
    written = [
        MetricPoint(
            step=step,
            loss=float(rng.random()),
            lr=float(rng.random()) * 1e-3,
            grad_norm=float(rng.random()),
            samples_per_s=700.5,
            world_size=2,
            wall_time=time.time(),
            user_metrics={"accuracy": float(rng.random())},
        )
        for step in range(1, 101)
    ]
    written.append(MetricPoint(step=100, val_loss=3.25))  # a validation point beside its step's training point
    events.points(written[:50], recoveries=0)
    assert sorted(_read(tmp_path)) == list(range(1, 51))  # flushed with its batch: a live TensorBoard sees it
    events.points(written[50:], recoveries=1)
    events.close()

    read = _read(tmp_path)
    assert sorted(read) == list(range(1, 101))
    for point in written[:-1]:
        assert read[point.step]["train/loss"] == np.float32(point.loss)
        assert read[point.step]["train/lr"] == np.float32(point.lr)
        assert read[point.step]["train/grad_norm"] == np.float32(point.grad_norm)
        assert read[point.step]["train/samples_per_s"] == np.float32(700.5)
        assert read[point.step]["train/world_size"] == 2.0
        assert read[point.step]["train/recoveries"] == (0.0 if point.step <= 50 else 1.0)
        assert read[point.step]["train/accuracy"] == np.float32(point.user_metrics["accuracy"])  # the user's own
    assert read[100]["train/val_loss"] == 3.25
    assert "train/val_loss" not in read[99]


def test_events_for_remote_storage_are_copied_there_whole_at_the_end(tmp_path: Path) -> None:
    import fsspec

    events = TensorBoardEvents("memory://tensorboard-test/job/attempt-1")
    events.points(
        [MetricPoint(step=step, loss=1.0 / step, wall_time=time.time()) for step in range(1, 4)], recoveries=0
    )
    events.close()
    remote = fsspec.filesystem("memory")
    [name] = remote.ls("/tensorboard-test/job/attempt-1", detail=False)
    assert "tfevents" in name
    (tmp_path / "copy").mkdir()
    remote.get_file(name, str(tmp_path / "copy" / Path(name).name))
    read = _read(tmp_path / "copy")
    assert {step: values["train/loss"] for step, values in read.items()} == {1: 1.0, 2: 0.5, 3: np.float32(1 / 3)}


def test_a_failed_copy_to_remote_storage_is_logged_and_retried_not_raised(tmp_path: Path, monkeypatch, caplog) -> None:
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    events = TensorBoardEvents("memory://tensorboard-outage/job/attempt-1")
    real_put_file = MemoryFileSystem.put_file

    def storage_outage(*args, **kwargs) -> None:
        raise OSError("outage")

    monkeypatch.setattr(MemoryFileSystem, "put_file", storage_outage)
    monkeypatch.setattr("ringmaster.workers.driver.training_log._UPLOAD_EVERY_S", 0.0)
    events.points([MetricPoint(step=1, loss=1.0, wall_time=time.time())], recoveries=0)
    assert "TensorBoard event files not copied to memory://tensorboard-outage/job/attempt-1" in caplog.text
    monkeypatch.setattr(MemoryFileSystem, "put_file", real_put_file)
    events.points([MetricPoint(step=2, loss=0.5, wall_time=time.time())], recoveries=0)
    events.close()
    [name] = fsspec.filesystem("memory").ls("/tensorboard-outage/job/attempt-1", detail=False)
    (tmp_path / "copy").mkdir()
    fsspec.filesystem("memory").get_file(name, str(tmp_path / "copy" / Path(name).name))
    assert sorted(_read(tmp_path / "copy")) == [1, 2]


def test_the_progress_line_shows_the_loss_fns_own_metrics_after_the_loss() -> None:
    training_log = TrainingLog(JobSpec(name="progress", model="mlp", train={"steps": 10}), "job", 1, "default")
    training_log.metrics([MetricPoint(step=3, loss=0.5, user_metrics={"accuracy": 0.8125, "top-5": 1.0})], 2)
    assert training_log.progress_line(world_size=2) == "step 3/10  loss 0.5000  accuracy 0.8125  top-5 1  world size 2"
