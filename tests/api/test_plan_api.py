"""POST /v1/plan and `ringmaster plan`: the options table, the pick and its reasons, and 422s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from ringmaster.api.app import create_app
from ringmaster.cli import app as cli
from ringmaster.cli import planning
from ringmaster.service.client import RingmasterClient
from ringmaster.service.planner import builtin_model_size
from ringmaster.service.settings import Settings
from tests.support.api_tokens import authorize


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    # The planner touches no table, so one database (SQLite) is enough here.
    with TestClient(
        create_app(Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}", data_dir=tmp_path))
    ) as test_client:
        authorize(test_client, admin=False)
        yield test_client


def _plan(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _option(result: dict[str, Any], label: str) -> dict[str, Any]:
    [option] = [option for option in result["options"] if option["label"] == label]
    return option


def test_plan_7b_on_8_gpus_of_80_gb(client: TestClient) -> None:
    result = _plan(client, parameters=7 * 10**9, gpu_memory_gb=80, gpus_per_node=8, nodes=1)
    assert (result["world_size"], result["precision"], result["bytes_per_parameter"]) == (8, "mixed", 16)
    ddp, zero3 = _option(result, "ddp (dp=8)"), _option(result, "fsdp zero3 (dp=8)")
    assert ddp["memory_per_gpu"]["total_gb"] == 112 and ddp["fits"] is False
    assert zero3["memory_per_gpu"]["total_gb"] == 14 and zero3["fits"] is True
    assert (
        zero3["communication_per_step"]["data_parallel_gb"]
        == 1.5 * ddp["communication_per_step"]["data_parallel_gb"]
        == 36.75
    )
    assert _option(result, "pipeline (dp=2, pp=4)")["bubble_fraction"] == "3/11"
    recommendation = result["recommendation"]
    assert recommendation["label"] == "zero1 (dp=8)" and recommendation["spec"] == {
        "strategy": "zero1",
        "parallel": {"tp": 1, "pp": 1},
    }
    assert result["reasons"] == [
        "does not fit on one GPU: DDP needs 112.00 GB > 80.00 GB",
        "cheapest that fits: zero1 (dp=8), 38.50 GB per GPU",
    ]


def test_plan_13b_on_4_gpus_of_40_gb_fits_nothing_and_says_what_would(client: TestClient) -> None:
    result = _plan(client, parameters=13 * 10**9, gpu_memory_gb=40, gpus_per_node=4)
    assert result["recommendation"] is None
    assert _option(result, "fsdp zero3 (dp=4)")["memory_per_gpu"]["total_gb"] == 52
    assert "fsdp zero3 over 6 GPUs fits (34.67 GB per GPU)" in result["reasons"]


def test_plan_a_builtin_from_its_options_with_activations(client: TestClient) -> None:
    options = {"n_layers": 4, "n_heads": 4, "dim": 128, "seq_len": 256}
    result = _plan(
        client,
        model="tiny-gpt",
        model_options=options,
        gpu_memory_gb=16,
        gpus_per_node=4,
        precision="bf16",
        micro_batch_size=8,
    )
    assert result["parameters"] == builtin_model_size("tiny-gpt", options).parameters
    assert result["recommendation"]["label"] == "ddp (dp=4)"
    tensor = _option(result, "tensor (dp=1, tp=4)")
    assert (
        tensor["memory_per_gpu"]["activations_gb"] < _option(result, "ddp (dp=4)")["memory_per_gpu"]["activations_gb"]
    )
    assert (
        tensor["communication_per_step"]["tensor_parallel_gb"] > 0
        and tensor["communication_per_step"]["total_gb"] is not None
    )


@pytest.mark.parametrize(
    ("body", "field", "needle"),
    [
        ({"parameters": 10**9, "model": "tiny-gpt"}, "parameters", "either parameters"),
        ({}, "model", "either parameters"),
        ({"model": "resnet"}, "model", "must be a built-in"),
        ({"model": "tiny-gpt", "model_options": {"n_layer": 3}}, "model_options.n_layer", "has no option 'n_layer'"),
        ({"parameters": 10**9, "layers": 4}, "hidden", "together"),
        ({"parameters": 10**9, "precision": "fp8"}, "precision", "Input should be"),
        ({"parameters": 0}, "parameters", "greater than or equal to 1"),
        ({"model": "mlp", "gpu_memory_gb": 5e-324}, "gpu_memory_gb", "greater than or equal to 0.001"),  # once a 500
    ],
)
def test_bad_plan_request_is_422_naming_the_field(
    client: TestClient, body: dict[str, Any], field: str, needle: str
) -> None:
    response = client.post("/v1/plan", json={"gpu_memory_gb": 80, **body})
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["field"] == field and needle in error["msg"]


@pytest.fixture
def cli_on(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """The CLI talking to the in-process API instead of a server."""
    api = RingmasterClient("http://testserver")
    api._http = client  # the TestClient is an HTTP client on the app (httpx2's where installed: starlette prefers it)
    monkeypatch.setattr(planning, "_client", lambda _url: api)
    return CliRunner()


def test_cli_plan_prints_the_table_and_the_pick(cli_on: CliRunner) -> None:
    result = cli_on.invoke(cli.app, ["plan", "--parameters", "7B", "--gpu-memory-gb", "80"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "zero1 (dp=8) ★" in result.output and "fsdp zero3 (dp=8)" in result.output
    assert "recommended: zero1 (dp=8)" in result.output
    assert "DDP needs 112.00 GB > 80.00 GB" in result.output and "3/11 = 27.3%" in result.output


def test_cli_plan_json_and_bad_input(cli_on: CliRunner) -> None:
    result = cli_on.invoke(cli.app, ["plan", "--model", "tiny-gpt", "-o", "dim=128", "--gpu-memory-gb", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["parameters"] == builtin_model_size("tiny-gpt", {"dim": 128}).parameters
    bad = cli_on.invoke(cli.app, ["plan", "--model", "tiny-gpt", "-o", "dims=128", "--gpu-memory-gb", "1"])
    assert bad.exit_code == 1 and "invalid plan request" in bad.output and "model_options.dims" in bad.output


@pytest.mark.parametrize(
    ("text", "count"),
    [("7B", 7 * 10**9), ("350m", 350 * 10**6), ("1.5T", 15 * 10**11), ("13e9", 13 * 10**9), ("7_000", 7000)],
)
def test_cli_reads_parameter_counts_the_way_people_write_them(text: str, count: int) -> None:
    assert planning._count(text) == count


def test_a_builtins_size_options_may_be_integral_floats_as_json_integers_are(client: TestClient) -> None:
    as_floats = _plan(client, model="tiny-gpt", model_options={"n_layers": 4.0, "dim": 128.0}, gpu_memory_gb=16)
    as_ints = _plan(client, model="tiny-gpt", model_options={"n_layers": 4, "dim": 128}, gpu_memory_gb=16)
    assert as_floats["parameters"] == as_ints["parameters"]
