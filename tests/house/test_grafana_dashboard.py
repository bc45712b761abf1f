"""deploy/grafana/ringmaster-dashboard.json charts only series that exist: the drivers' Ray training series and the
control plane's own /metrics, whose names are read here from the code that makes them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastapi.testclient import TestClient

from ringmaster.api.app import create_app
from ringmaster.service.settings import Settings
from ringmaster.workers.driver.training_log import TRAINING_SERIES

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "ringmaster-dashboard.json"


def _queried_series(dashboard: dict) -> set[str]:
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    expressions += [variable["query"] for variable in dashboard["templating"]["list"] if variable["type"] == "query"]
    return {name for expression in expressions for name in re.findall(r"\b((?:ray_)?ringmaster_\w+)", expression)}


def test_every_chart_queries_a_series_ringmaster_exports(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    with TestClient(create_app(Settings(data_dir=tmp_path))) as client:
        exposition = client.get("/metrics").text
    control_plane = set(re.findall(r"^# TYPE (ringmaster_\w+) (\w+)", exposition, re.MULTILINE))
    exported = {f"ray_ringmaster_train_{name}" for name in TRAINING_SERIES}
    for name, kind in control_plane:
        exported |= {f"{name}_bucket"} if kind == "histogram" else {name}  # a counter's TYPE line names it with _total
    queried = _queried_series(dashboard)
    assert queried, "the dashboard queries nothing"
    assert queried <= exported, f"charts of series nobody exports: {sorted(queried - exported)}"
    assert {f"ray_ringmaster_train_{name}" for name in TRAINING_SERIES} <= queried, "a training series has no chart"
    assert {"ringmaster_jobs", "ringmaster_dispatch_latency_seconds_bucket"} <= queried
