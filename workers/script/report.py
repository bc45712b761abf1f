"""`ringmaster.report(step, **metrics)`: a script's own metric points, for the curves a person sees.

Torch-free and Ray-free: the script imports it in its own process. Each call appends one JSON line to the file its
worker names (RINGMASTER_METRICS_FILE); the worker of rank 0 reads the file as it grows and the driver forwards the
points to the control plane. Outside ringmaster (no such variable, e.g. under bare torchrun) a call does nothing.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time

from ringmaster.service.reports import MAX_USER_METRICS, USER_METRIC_NAME

METRICS_FILE_VARIABLE = "RINGMASTER_METRICS_FILE"
# The metrics the control plane keeps in columns of their own (service/reports.py's MetricPoint); any other name is
# a metric of the script's own (MetricPoint.user_metrics).
KEPT_METRICS = ("loss", "val_loss", "lr", "grad_norm", "samples_per_s", "step_time_s")

_own_names: set[str] = set()  # the script's own metric names so far: at most MAX_USER_METRICS
_warned: set[str] = set()


def report(step: int, **metrics: float) -> None:
    """Record `metrics` at `step`: those of KEPT_METRICS, and up to MAX_USER_METRICS names of the script's own (a
    name past those, or one no curve can be named by, is ignored with one warning on stderr)."""
    path = os.environ.get(METRICS_FILE_VARIABLE)
    if not path:
        return
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"ringmaster.report: step must be an integer of at least 0, got {step!r}")
    point: dict[str, object] = {"step": step, "wall_time": time.time()}
    own: dict[str, float] = {}
    for name, value in metrics.items():
        number = float(value)
        if not math.isfinite(number):
            continue
        if name in KEPT_METRICS:
            point[name] = number
        elif _own_name(name):
            own[name] = number
    if own:
        point["user_metrics"] = own
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(point) + "\n")


def _own_name(name: str) -> bool:
    """Whether the control plane takes `name` as a metric of the script's own; says why not once, if not."""
    if name in _own_names:
        return True
    if re.fullmatch(USER_METRIC_NAME, name) and len(_own_names) < MAX_USER_METRICS:
        _own_names.add(name)
        return True
    if name not in _warned:
        _warned.add(name)
        why = (
            f"a metric name is a letter, then up to 63 letters, digits or '_.-/' ({USER_METRIC_NAME})"
            if not re.fullmatch(USER_METRIC_NAME, name)
            else f"a script keeps at most {MAX_USER_METRICS} metrics of its own besides {', '.join(KEPT_METRICS)}"
        )
        print(f"ringmaster.report: {name!r} ignored: {why}", file=sys.stderr)
    return False
