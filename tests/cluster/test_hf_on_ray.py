"""Hugging Face models through the real job path (REST → queue → Ray job → workers): `hf:` models and a user's own
function returning a transformers model follow one process's losses and grad norms under the sharding and splitting
strategies (tests/workers/models/test_hf.py compares every strategy with ddp on local ranks)."""

from __future__ import annotations

import pytest
import torch

from harness.local_control_plane import wait_for_state
from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec
from ringmaster.workers.trainer import TrainContext, run_training
from tests.workers.models.test_hf import hf_spec

pytestmark = pytest.mark.integration

USER_GPT2 = {"model": "examples.hf_user_model:build", "model_options": {"layers": 2, "width": 32, "seq_len": 32}}
JOBS = {
    "gpt2-fsdp-zero3": hf_spec("gpt2", "fsdp-zero3"),
    "llama-tensor": hf_spec("llama", "tensor"),
    "user-gpt2-fsdp-zero3": {**hf_spec("gpt2", "fsdp-zero3"), **USER_GPT2, "name": "user-gpt2-zero3"},
}


@pytest.fixture(scope="module")
def finished(ray_server) -> dict[str, list[dict]]:
    """Each job's per-step metric rows, as the metrics API serves them."""
    client = ray_server.client()
    ids = {name: client.submit(spec)["id"] for name, spec in JOBS.items()}
    rows = {}
    for name, job_id in ids.items():
        done = wait_for_state(client, job_id, {"SUCCEEDED", "FAILED", "CANCELLED"})
        assert done["state"] == "SUCCEEDED", (name, done["error"])
        rows[name] = [row for row in client.metrics(job_id)["items"] if row["loss"] is not None]
    return rows


def _one_process(spec: dict, root) -> list:
    """The same job as one process on the same global batches: what every layout must compute."""
    one = JobSpec.model_validate(
        {
            **spec,
            "strategy": "ddp",
            "parallel": {},
            "workers": {"min": 1, "max": 1},
            "train": {**spec["train"], "micro_batch_size": 4},
        }
    )
    points: list = []
    run_training(
        one, TrainContext(0, 1, torch.device("cpu"), "one", str(root), sink=CallbackSink(on_metric=points.append))
    )
    return [point for point in points if point.loss is not None]


@pytest.mark.parametrize("name", list(JOBS))
def test_follows_one_process_through_rest(
    finished: dict[str, list[dict]], name: str, tmp_path, single_rank_group
) -> None:
    reference = _one_process(JOBS[name], tmp_path)
    assert len(finished[name]) == len(reference) == JOBS[name]["train"]["steps"]
    assert [row["loss"] for row in finished[name]] == pytest.approx([point.loss for point in reference], abs=1e-5)
    assert [row["grad_norm"] for row in finished[name]] == pytest.approx(
        [point.grad_norm for point in reference], rel=1e-5
    )
