"""Where a script's metric points come from, each read as it grows: the JSON lines `ringmaster.report` appends, and
the TensorBoard event files the script writes (its scalars whose tags name a metric ringmaster keeps).

Each source's `read()` returns the points that appeared since the last call, as MetricPoint fields (the driver adds
the world size and forwards them as MetricPoint; the control plane merges the fields of one step, whichever source
gave them).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from ringmaster.workers.script.report import KEPT_METRICS

log = logging.getLogger("ringmaster.script")

# TensorBoard tags that name a metric ringmaster keeps: plain names, and a Hugging Face Trainer's (train/…, eval/…).
TENSORBOARD_TAGS = {
    "loss": "loss",
    "train/loss": "loss",
    "train_loss": "loss",
    "val_loss": "val_loss",
    "val/loss": "val_loss",
    "eval/loss": "val_loss",
    "eval_loss": "val_loss",
    "lr": "lr",
    "learning_rate": "lr",
    "train/learning_rate": "lr",
    "grad_norm": "grad_norm",
    "train/grad_norm": "grad_norm",
    "samples_per_s": "samples_per_s",
    "train/train_samples_per_second": "samples_per_s",
    "step_time_s": "step_time_s",
}
_EVENT_FILE_MARK = "tfevents"


class ReportedMetrics:
    """The file `ringmaster.report` appends to: complete lines only (a line being written is read next time)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                chunk = file.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        points = []
        for line in complete.splitlines():
            try:
                point = json.loads(line)
            except ValueError:
                continue  # not written by ringmaster.report
            if isinstance(point, dict) and isinstance(point.get("step"), int) and point["step"] >= 0:
                kept = {name: point[name] for name in KEPT_METRICS if isinstance(point.get(name), (int, float))}
                own = point.get("user_metrics")
                if isinstance(own, dict) and own:
                    kept["user_metrics"] = own
                points.append({"step": point["step"], "wall_time": point.get("wall_time"), **kept})
        return points


class TensorBoardScalars:
    """Every TensorBoard event file under a directory (at any depth), each read as it grows by its own loader."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self._loaders: dict[Path, Any] = {}  # EventFileLoader, untyped

    def read(self) -> list[dict[str, Any]]:
        if not self.directory.is_dir():
            return []
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        for path in sorted(self.directory.rglob(f"*{_EVENT_FILE_MARK}*")):
            if path not in self._loaders and path.is_file():
                self._loaders[path] = EventFileLoader(str(path))
        by_step: dict[int, dict[str, Any]] = {}
        for path, loader in self._loaders.items():
            try:
                events = list(loader.Load())
            except Exception as error:  # a torn or foreign file: its events so far are kept, it is read again later
                log.warning("cannot read TensorBoard events from %s: %s", path, error)
                continue
            for event in events:
                for value in event.summary.value:
                    name = TENSORBOARD_TAGS.get(value.tag)
                    if name is None:
                        continue  # not a metric ringmaster keeps, whatever its kind (text, image, histogram)
                    number = _scalar(value)
                    if number is None:
                        continue
                    point = by_step.setdefault(int(event.step), {"step": int(event.step), "wall_time": event.wall_time})
                    point[name] = number
        return [by_step[step] for step in sorted(by_step) if step >= 0]


def _scalar(value: Any) -> float | None:
    """A summary value's number: a scalar tensor (what the loader makes of every scalar), or a legacy simple_value.
    None for anything else, such as the text a Hugging Face Trainer writes (its arguments) before its first step."""
    if value.HasField("tensor"):
        from tensorboard.util.tensor_util import make_ndarray

        array = make_ndarray(value.tensor)
        if array.size != 1 or array.dtype.kind not in "biuf":
            return None
        number = float(array.reshape(()))
    elif value.HasField("simple_value"):
        number = float(value.simple_value)
    else:
        return None
    return number if math.isfinite(number) else None
