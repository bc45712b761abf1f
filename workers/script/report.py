"""`ringmaster.report(step, **metrics)`: a script's own metric points, for the curves a person sees.

Torch-free and Ray-free: the script imports it in its own process. Each call appends one JSON line to the file its
worker names (RINGMASTER_METRICS_FILE); the worker of rank 0 reads the file as it grows and the driver forwards the
points to the control plane. Outside ringmaster (no such variable, e.g. under bare torchrun) a call does nothing.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

METRICS_FILE_VARIABLE = "RINGMASTER_METRICS_FILE"
# The metrics the control plane keeps for each step (service/reports.py's MetricPoint), besides the step itself.
KEPT_METRICS = ("loss", "val_loss", "lr", "grad_norm", "samples_per_s", "step_time_s")

_warned: set[str] = set()


def report(step: int, **metrics: float) -> None:
    """Record `metrics` (of KEPT_METRICS) at `step`; another name is ignored with one warning on stderr."""
    path = os.environ.get(METRICS_FILE_VARIABLE)
    if not path:
        return
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"ringmaster.report: step must be an integer of at least 0, got {step!r}")
    point: dict[str, float | int] = {"step": step, "wall_time": time.time()}
    for name, value in metrics.items():
        if name not in KEPT_METRICS:
            if name not in _warned:
                _warned.add(name)
                print(
                    f"ringmaster.report: {name!r} is not a metric ringmaster keeps ({', '.join(KEPT_METRICS)}); "
                    "ignored",
                    file=sys.stderr,
                )
            continue
        number = float(value)
        if math.isfinite(number):
            point[name] = number
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(point) + "\n")
