"""The planner at submit and after: auto resolved with its reasons, jobs that cannot fit their GPUs or nodes
rejected before anything is written, and each rank's measured memory stored beside its prediction."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ringmaster.api.app import create_app
from ringmaster.service.auth import new_report_token
from ringmaster.service.db import session_scope
from ringmaster.service.job_plan import ClusterShape
from ringmaster.service.jobs import apply_driver_report, get_job, mark_admitted
from ringmaster.service.reports import DriverReport
from ringmaster.service.settings import Settings
from tests.support.api_tokens import authorize

USER_7B = {
    "name": "big",
    "model": "examples.user_model:build",
    "model_parameters": 7 * 10**9,
    "workers": {"min": 8, "max": 8, "gpus_per_worker": 1, "gpu_memory_gb": 80},
    "train": {"global_batch_size": 16, "micro_batch_size": 2, "precision": "bf16"},
}


@pytest.fixture
def client(db_url: str, tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(database_url=db_url, data_dir=tmp_path))) as test_client:
        authorize(test_client)
        yield test_client


def _with(spec: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """The spec with nested sections updated key by key."""
    merged = dict(spec)
    for key, value in changes.items():
        merged[key] = (
            {**merged[key], **value} if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def _rejected(client: TestClient, spec: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422, response.text
    assert client.get("/v1/jobs").json()["total"] == 0
    [error] = response.json()["detail"]
    return error


def _events(client: TestClient, job_id: str, kind: str) -> list[dict[str, Any]]:
    return [event for event in client.get(f"/v1/jobs/{job_id}/events").json()["items"] if event["kind"] == kind]


# --- does it fit the GPUs ------------------------------------------------------------------------------------------


def test_strategy_that_cannot_fit_gpu_memory_is_422_naming_what_it_needs_and_what_would_fit(client: TestClient) -> None:
    error = _rejected(client, USER_7B)  # strategy ddp: 16 bytes × 7B on each GPU
    assert error["field"] == "workers.gpu_memory_gb" and error["type"] == "does_not_fit"
    assert error["msg"].startswith(
        "strategy ddp needs 112.00 GB per GPU at 8 workers "
        "(parameters 28.00 GB + gradients 28.00 GB + optimizer 56.00 GB), "
        "more than workers.gpu_memory_gb (80.00 GB); would fit at 8 workers: strategy: zero1 (63.00 GB per GPU); "
        "strategy: fsdp, parallel: {shard: zero2} (38.50 GB per GPU)"
    )


def test_seed_13b_over_4_gpus_of_40_gb_is_rejected_with_the_gpus_that_would_fit(client: TestClient) -> None:
    spec = _with(
        USER_7B,
        model_parameters=13 * 10**9,
        strategy="fsdp",
        parallel={"shard": "zero3"},
        workers={"min": 4, "max": 4, "gpu_memory_gb": 40},
        train={"global_batch_size": 8},
    )
    error = _rejected(client, spec)
    assert "strategy fsdp (zero3) needs 52.00 GB per GPU at 4 workers" in error["msg"]
    assert (
        "nothing fits at 4 workers" in error["msg"] and "fsdp zero3 over 6 GPUs fits (34.67 GB per GPU)" in error["msg"]
    )


def test_strategy_that_fits_is_stored_as_submitted(client: TestClient) -> None:
    spec = _with(USER_7B, strategy="fsdp", parallel={"shard": "zero3"})
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["strategy"] == "fsdp" and _events(client, response.json()["id"], "plan") == []


# --- strategy: auto ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu_gb", "strategy", "shard", "label"),
    [(80, "zero1", None, "zero1 (dp=8)"), (24, "fsdp", "zero3", "fsdp zero3 (dp=8)")],
)
def test_auto_is_stored_as_the_planners_pick_with_an_event_saying_why(
    client: TestClient, gpu_gb: float, strategy: str, shard: str | None, label: str
) -> None:
    response = client.post("/v1/jobs", json=_with(USER_7B, strategy="auto", workers={"gpu_memory_gb": gpu_gb}))
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["spec"]["strategy"] == strategy and (shard is None or job["spec"]["parallel"]["shard"] == shard)
    [event] = _events(client, job["id"], "plan")
    assert event["message"].startswith(
        f"strategy auto resolved to {label}: does not fit on one GPU: DDP needs 112.00 GB > {gpu_gb}.00 GB"
    )
    assert (
        event["data"]["requested"] == "auto"
        and event["data"]["strategy"] == strategy
        and event["data"]["world_size"] == 8
    )
    assert event["data"]["predicted_per_gpu_bytes"]["total"] <= gpu_gb * 10**9


def test_auto_without_gpu_memory_is_ddp_and_says_why(client: TestClient) -> None:
    response = client.post("/v1/jobs", json={"name": "small", "model": "tiny-gpt", "strategy": "auto"})
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["strategy"] == "ddp"
    [event] = _events(client, response.json()["id"], "plan")
    assert "workers.gpu_memory_gb is not given" in event["message"]


def test_auto_for_a_user_model_of_unknown_size_is_ddp_and_says_why(client: TestClient) -> None:
    spec = {key: value for key, value in _with(USER_7B, strategy="auto").items() if key != "model_parameters"}
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    [event] = _events(client, response.json()["id"], "plan")
    assert "set model_parameters for a user model" in event["message"]


def test_auto_with_nothing_that_fits_is_422(client: TestClient) -> None:
    error = _rejected(client, _with(USER_7B, strategy="auto", workers={"gpu_memory_gb": 10}))
    assert error["field"] == "workers.gpu_memory_gb"
    assert error["msg"].startswith(
        "strategy auto: does not fit on one GPU: DDP needs 112.00 GB > 10.00 GB; nothing fits on 8 GPUs"
    )
    assert "fsdp zero3 over 12 GPUs fits" in error["msg"]


def test_auto_skips_picks_that_break_the_spec_and_says_so(client: TestClient) -> None:
    # 3.5 MB GPUs only fit tiny-gpt with its activations split by tensor parallelism, but an elastic 4-6 workers
    # cannot keep tp groups whole at 5 workers.
    client.app.state.cluster_shape_provider = lambda: ClusterShape(cpus_per_node=8)  # type: ignore[attr-defined]
    spec = {
        "name": "tiny",
        "model": "tiny-gpt",
        "strategy": "auto",
        "workers": {"min": 4, "max": 6, "gpu_memory_gb": 0.0035},
        "train": {"global_batch_size": 240, "micro_batch_size": 4},
    }
    error = _rejected(client, spec)
    assert "cheapest that fits: tensor (dp=2, tp=2)" in error["msg"]
    assert (
        "tensor (dp=2, tp=2) breaks the spec: workers: every world size in [4, 6] must be a multiple of parallel.tp"
        in error["msg"]
    )


def test_builtin_model_is_sized_by_its_options_not_model_parameters(client: TestClient) -> None:
    error = _rejected(client, {"name": "tiny", "model": "tiny-gpt", "strategy": "auto", "model_parameters": 1000})
    assert error["field"] == "model_parameters" and "sized from model_options" in error["msg"]


# --- tensor parallelism stays inside a node ------------------------------------------------------------------------

TENSOR_4 = {
    "name": "tp",
    "model": "tiny-gpt",
    "strategy": "tensor",
    "parallel": {"tp": 4},
    "workers": {"min": 4, "max": 4, "gpus_per_worker": 4},
    "train": {"global_batch_size": 16, "micro_batch_size": 4},
}


def test_tp_that_does_not_divide_the_workers_per_node_is_422_saying_what_fits(client: TestClient) -> None:
    client.app.state.cluster_shape_provider = lambda: ClusterShape(gpus_per_node=8, nodes=4)  # type: ignore[attr-defined]
    error = _rejected(client, TENSOR_4)
    assert error["field"] == "parallel.tp"
    assert error["msg"] == (
        "parallel.tp (4) must divide the workers per node (2 = 8 GPUs per node / 4 gpus_per_worker) so that each "
        "tensor-parallel group stays inside one node; tp that would fit: 2"
    )
    assert client.post("/v1/jobs", json=_with(TENSOR_4, workers={"gpus_per_worker": 2})).status_code == 201


def test_cpu_jobs_count_workers_per_node_by_cpus(client: TestClient) -> None:
    client.app.state.cluster_shape_provider = lambda: ClusterShape(cpus_per_node=4)  # type: ignore[attr-defined]
    spec = _with(TENSOR_4, parallel={"tp": 8}, workers={"min": 8, "max": 8, "gpus_per_worker": 0, "cpus_per_worker": 1})
    error = _rejected(client, spec)
    assert "(4 = 4 CPUs per node / 1 cpus_per_worker)" in error["msg"] and error["msg"].endswith(
        "tp that would fit: 2, 4"
    )


def test_a_worker_larger_than_a_node_is_422(client: TestClient) -> None:
    client.app.state.cluster_shape_provider = lambda: ClusterShape(gpus_per_node=2)  # type: ignore[attr-defined]
    assert _rejected(client, TENSOR_4)["field"] == "workers.gpus_per_worker"


def test_more_workers_than_the_nodes_hold_is_422_on_workers_min(client: TestClient) -> None:
    client.app.state.cluster_shape_provider = lambda: ClusterShape(gpus_per_node=8, nodes=2)  # type: ignore[attr-defined]
    # 2 nodes × (8 GPUs / 2 per worker) = 8 workers; 2520 divides by every world size from 2 to 9
    ddp = {
        "name": "ddp",
        "model": "tiny-gpt",
        "strategy": "ddp",
        "workers": {"min": 9, "max": 9, "gpus_per_worker": 2},
        "train": {"global_batch_size": 2520, "micro_batch_size": 1},
    }
    error = _rejected(client, ddp)
    assert error["field"] == "workers.min"
    assert error["msg"].startswith(
        "workers.min (9) is more workers than the cluster holds: 2 node(s) × 4 "
        "(8 GPUs per node / 2 gpus_per_worker) = 8"
    )
    assert client.post("/v1/jobs", json=_with(ddp, workers={"min": 8, "max": 8})).status_code == 201
    # workers.max above what the nodes hold is an elastic job's ceiling, not a refusal
    assert client.post("/v1/jobs", json=_with(ddp, workers={"min": 2, "max": 9})).status_code == 201


def test_unknown_cluster_shape_skips_the_node_check(client: TestClient) -> None:
    client.app.state.cluster_shape_provider = lambda: None  # type: ignore[attr-defined]
    assert client.post("/v1/jobs", json=TENSOR_4).status_code == 201


def test_settings_give_the_cluster_shape_when_no_provider_does(db_url: str, tmp_path: Path) -> None:
    settings = Settings(database_url=db_url, data_dir=tmp_path, gpus_per_node=8)
    with TestClient(create_app(settings, cluster_shape_provider=lambda: None)) as client:
        authorize(client)
        assert _rejected(client, TENSOR_4)["field"] == "parallel.tp"


# --- measured against predicted ------------------------------------------------------------------------------------

FSDP_JOB = {
    "name": "sharded",
    "model": "examples.user_model:build",
    "model_parameters": 1000,
    "strategy": "fsdp",
    "parallel": {"shard": "zero3"},
    "workers": {"min": 2, "max": 2},
    "train": {"global_batch_size": 8, "micro_batch_size": 4},
}


_report_tokens: dict[str, str] = {}  # job id -> its first attempt's report secret


def _admitted(client: TestClient, spec: dict[str, Any]) -> str:
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    secret, secret_hash = new_report_token()
    with session_scope(client.app.state.db.sessions) as session:  # type: ignore[attr-defined]
        mark_admitted(
            session, get_job(session, job_id), 1, f"ringmaster-{job_id}-1", None, 2, report_token_hash=secret_hash
        )
    _report_tokens[job_id] = secret
    return job_id


def _memory(rank: int, parameters: int, gradients: int, optimizer: int, dp: int = 2) -> dict[str, Any]:
    return {
        "rank": rank,
        "parameter_count": 1000,
        "parameters_bytes": parameters,
        "gradients_bytes": gradients,
        "optimizer_bytes": optimizer,
        "dp": dp,
    }


def _report(client: TestClient, job_id: str, body: dict[str, Any], attempt: int = 1) -> dict[str, Any]:
    response = client.post(
        f"/v1/internal/jobs/{job_id}/attempts/{attempt}/report",
        json=body,
        headers={"Authorization": f"Bearer {_report_tokens[job_id]}"},
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_memory_report_is_stored_once_per_rank_beside_the_prediction(client: TestClient) -> None:
    job_id = _admitted(client, FSDP_JOB)
    report = {"state": "RUNNING", "memory": [_memory(0, 2000, 2000, 4000), _memory(1, 2200, 2200, 4400)]}
    for _ in range(2):  # a replay changes nothing
        assert _report(client, job_id, report)["accepted"] is True
    memory = client.get(f"/v1/jobs/{job_id}").json()["memory"]
    predicted = {
        "parameters_bytes": 2000,
        "gradients_bytes": 2000,
        "optimizer_bytes": 4000,
        "total_bytes": 8000,
    }  # fp32 ZeRO-3 over 2
    assert [(m["attempt"], m["rank"], m["predicted"], m["ratio"]) for m in memory] == [
        (1, 0, predicted, 1.0),
        (1, 1, predicted, 1.1),
    ]
    assert memory[1]["measured"] == {
        "parameters_bytes": 2200,
        "gradients_bytes": 2200,
        "optimizer_bytes": 4400,
        "total_bytes": 8800,
    }
    assert client.get(f"/v1/jobs/{job_id}/metrics").json()["memory"] == memory


def test_later_measurement_of_a_rank_replaces_it_and_stale_attempts_are_ignored(client: TestClient) -> None:
    job_id = _admitted(client, FSDP_JOB)
    _report(client, job_id, {"state": "RUNNING", "memory": [_memory(0, 1, 1, 1)]})
    _report(client, job_id, {"memory": [_memory(0, 2000, 2000, 4000)]})
    with session_scope(client.app.state.db.sessions) as session:  # type: ignore[attr-defined]
        stale = apply_driver_report(session, job_id, 7, DriverReport.model_validate({"memory": [_memory(1, 5, 5, 5)]}))
    assert stale.accepted is False
    [rank] = client.get(f"/v1/jobs/{job_id}").json()["memory"]
    assert rank["rank"] == 0 and rank["measured"]["total_bytes"] == 8000 and rank["ratio"] == 1.0


def test_prediction_follows_the_jobs_strategy_and_precision(client: TestClient) -> None:
    spec = _with(FSDP_JOB, strategy="zero1", parallel={"shard": "zero3"}, train={"precision": "bf16"})
    spec["parallel"] = {}
    job_id = _admitted(client, spec)
    _report(client, job_id, {"state": "RUNNING", "memory": [_memory(0, 4000, 4000, 4000)]})
    [rank] = client.get(f"/v1/jobs/{job_id}").json()["memory"]
    # ZeRO-1 shards only AdamW's moments; bf16 autocast keeps fp32 parameters and gradients.
    assert rank["predicted"] == {
        "parameters_bytes": 4000,
        "gradients_bytes": 4000,
        "optimizer_bytes": 4000,
        "total_bytes": 12000,
    }


def test_fsdp_zero2_is_predicted_sharded_between_steps_where_it_is_measured(client: TestClient) -> None:
    job_id = _admitted(client, _with(FSDP_JOB, parallel={"shard": "zero2"}))
    _report(client, job_id, {"state": "RUNNING", "memory": [_memory(0, 2000, 2000, 4000)]})
    [rank] = client.get(f"/v1/jobs/{job_id}").json()["memory"]
    assert rank["predicted"]["total_bytes"] == 8000 and rank["ratio"] == 1.0


def test_hybrid_sharding_has_no_prediction(client: TestClient) -> None:
    job_id = _admitted(client, _with(FSDP_JOB, parallel={"shard": "hybrid"}))
    _report(client, job_id, {"state": "RUNNING", "memory": [_memory(0, 1, 1, 1)]})
    [rank] = client.get(f"/v1/jobs/{job_id}").json()["memory"]
    assert rank["predicted"] is None and rank["ratio"] is None and rank["measured"]["total_bytes"] == 3
