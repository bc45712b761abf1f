"""What the driver tells a person about the training: its log, as the Ray dashboard shows it (a progress line every
few seconds: step of the total, loss, samples/s, learning rate, world size, ETA; and one line for each event: group
formed, worker lost, re-formed, grew, checkpoint committed, validation loss), Ray's metrics (ray.util.metrics, tagged
with the job, for Ray's Prometheus and Grafana), and TensorBoard event files under the job's storage."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import struct
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import google_crc32c

from ringmaster.service.planner import format_duration
from ringmaster.service.reports import CheckpointRecord, MetricPoint
from ringmaster.service.spec import JobSpec

log = logging.getLogger("ringmaster.training")

PROGRESS_EVERY_S = 5.0
# ringmaster_train_<name>: the gauges each driver sets (deploy/grafana charts them).
TRAINING_SERIES = {
    "loss": "Training loss at the newest step.",
    "samples_per_s": "Samples per second at the newest step.",
    "step": "The newest completed step.",
    "world_size": "Workers in the training group.",
    "recoveries": "Times the group re-formed after losing a worker.",
    "lr": "Learning rate.",
}
_PACE_POINTS = 20  # the ETA's pace: the wall time over this many newest steps


class TrainingLog:
    def __init__(
        self,
        spec: JobSpec,
        job_id: str,
        attempt: int,
        tenant: str,
        every_s: float = PROGRESS_EVERY_S,
        tensorboard_dir: str | None = None,
    ) -> None:
        """`tensorboard_dir`: where this attempt's TensorBoard event files go (a path or fsspec URI); None: nowhere."""
        self.total_steps = None if spec.is_script else spec.train.steps  # a script's own loop: unknown here
        self.every_s = every_s
        self._recent: deque[MetricPoint] = deque(maxlen=_PACE_POINTS)
        self._logged_at = 0.0
        self._series = _RaySeries({"job_id": job_id, "job_name": spec.name, "tenant": tenant})
        self._tensorboard = TensorBoardEvents(tensorboard_dir) if tensorboard_dir else None
        self.recoveries = 0

    def metrics(self, points: list[MetricPoint], world_size: int) -> None:
        for point in points:
            if point.val_loss is not None:
                log.info("validation loss %.4f at step %d", point.val_loss, point.step)
            if point.loss is not None:
                self._recent.append(point)
        if self._tensorboard is not None:
            self._tensorboard.points(points, self.recoveries)
        if self._recent:
            self._series.set(self._recent[-1], world_size, self.recoveries)
        now = time.monotonic()
        if self._recent and now - self._logged_at >= self.every_s:
            self._logged_at = now
            log.info(self.progress_line(world_size))

    def progress_line(self, world_size: int) -> str:
        latest = self._recent[-1]
        of_total = f"/{self.total_steps}" if self.total_steps is not None else ""
        parts = [f"step {latest.step}{of_total}", f"loss {latest.loss:.4f}"]
        parts += [f"{name} {value:.4g}" for name, value in (latest.user_metrics or {}).items()]  # the loss_fn's own
        if latest.samples_per_s is not None:
            parts.append(f"{latest.samples_per_s:.1f} samples/s")
        if latest.lr is not None:
            parts.append(f"lr {latest.lr:.3g}")
        parts.append(f"world size {world_size}")
        oldest = self._recent[0]
        if self.total_steps is not None and latest.wall_time and oldest.wall_time and latest.step > oldest.step:
            pace = (latest.wall_time - oldest.wall_time) / (latest.step - oldest.step)
            parts.append(f"ETA {format_duration(max(0, self.total_steps - latest.step) * pace)}")
        return "  ".join(parts)

    def checkpoint(self, record: CheckpointRecord) -> None:
        took = (
            f" ({record.save_s:.2f}s, training blocked {record.blocked_s:.2f}s)"
            if record.save_s is not None and record.blocked_s is not None
            else ""
        )
        log.info("checkpoint committed at step %d%s: %s", record.step, took, record.uri)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()

    def event(self, message: str, state: str | None = None) -> None:
        if state == "RECOVERING":
            self.recoveries += 1
            self._series.recoveries(self.recoveries)
        level = {"FAILED": logging.ERROR, "RECOVERING": logging.WARNING}.get(state or "", logging.INFO)
        log.log(level, "%s%s", f"[{state}] " if state else "", message)


class _RaySeries:
    """Gauges in Ray's metrics API; without a Ray connection (a driver's unit test) there is nothing to export to."""

    def __init__(self, tags: dict[str, str]) -> None:
        self._tags = tags
        self._gauges = None
        try:
            from ray.util.metrics import Gauge

            keys = tuple(tags)
            self._gauges = {
                name: Gauge(f"ringmaster_train_{name}", description=text, tag_keys=keys)
                for name, text in TRAINING_SERIES.items()
            }
            for gauge in self._gauges.values():
                gauge.set_default_tags(tags)
        except Exception:
            log.debug("Ray metrics unavailable", exc_info=True)

    def set(self, point: MetricPoint, world_size: int, recoveries: int) -> None:
        if self._gauges is None:
            return
        for name, value in (
            ("loss", point.loss),
            ("samples_per_s", point.samples_per_s),
            ("step", point.step),
            ("world_size", world_size),
            ("recoveries", recoveries),
            ("lr", point.lr),
        ):
            if value is not None:
                self._gauges[name].set(value)

    def recoveries(self, count: int) -> None:
        if self._gauges is not None:
            self._gauges["recoveries"].set(count)


# MetricPoint field -> TensorBoard tag
_TENSORBOARD_TAGS = {
    "loss": "train/loss",
    "val_loss": "train/val_loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "samples_per_s": "train/samples_per_s",
    "world_size": "train/world_size",
}
_UPLOAD_EVERY_S = 10.0


class TensorBoardEvents:
    """An attempt's scalars as a TensorBoard event file of tensorboard's Event protos (the driver never imports
    torch). Each metric point is one event holding all its scalars as simple values, as torch's
    SummaryWriter.add_scalar writes them. The records are framed here (TFRecord: length, data, each with a masked
    CRC-32C) with google-crc32c's C checksum, written in this thread and flushed once a batch: tensorboard's own
    writer computes a pure-Python CRC and hands each event to a thread of its own, a tenth of a millisecond a step on
    the CPUs the training shares, where a driver reports dozens of steps a second. A local directory is written in
    place; for a remote URI the file is written in a local directory and copied there every few seconds and at the
    end, through fsspec like the checkpoints."""

    def __init__(self, directory: str) -> None:
        from tensorboard.compat.proto import event_pb2

        self._remote = directory if "://" in directory and not directory.startswith("file://") else None
        self._local = (
            Path(tempfile.mkdtemp(prefix="ringmaster-tb-")) if self._remote else Path(directory.removeprefix("file://"))
        )
        self._local.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads every file whose name holds "tfevents"; the host and pid keep two writers' apart.
        self._file = (
            self._local / f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        ).open("ab")
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self._uploaded_at = time.monotonic()

    def points(self, points: list[MetricPoint], recoveries: int) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        for point in points:
            scalars = {tag: getattr(point, field) for field, tag in _TENSORBOARD_TAGS.items()}
            if point.loss is not None:
                scalars["train/recoveries"] = recoveries
            # The user's own metrics, beside the loss (the trainer keeps their names apart from the tags above).
            scalars.update({f"train/{name}": value for name, value in (point.user_metrics or {}).items()})
            values = [
                summary_pb2.Summary.Value(tag=tag, simple_value=value)
                for tag, value in scalars.items()
                if value is not None
            ]
            if values:
                self._write(
                    event_pb2.Event(
                        wall_time=point.wall_time or time.time(),
                        step=point.step,
                        summary=summary_pb2.Summary(value=values),
                    )
                )
        self._file.flush()  # a TensorBoard watching the directory sees each batch as it comes
        if self._remote and time.monotonic() - self._uploaded_at >= _UPLOAD_EVERY_S:
            self._upload()

    def _write(self, event: Any) -> None:  # an event_pb2.Event (tensorboard ships no types)
        data = event.SerializeToString()
        length = struct.pack("<Q", len(data))
        self._file.write(length + struct.pack("<I", _masked_crc(length)) + data + struct.pack("<I", _masked_crc(data)))

    def _upload(self) -> None:
        """Copy the file as last flushed; a failed copy is retried at the next, never fails the job."""
        import fsspec

        self._uploaded_at = time.monotonic()
        try:
            filesystem, root = fsspec.core.url_to_fs(self._remote)
            for path in self._local.iterdir():
                filesystem.put_file(str(path), f"{root.rstrip('/')}/{path.name}")
        except Exception:
            log.warning("TensorBoard event files not copied to %s", self._remote, exc_info=True)

    def close(self) -> None:
        self._file.close()
        if self._remote:
            self._upload()
            shutil.rmtree(self._local, ignore_errors=True)


def _masked_crc(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C, rotated and offset (a CRC of data that holds CRCs is weak otherwise)."""
    crc: int = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
