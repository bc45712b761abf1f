"""Hugging Face models through the real job path (REST → queue → Ray job → workers): `hf:` models and a user's own
function returning a transformers model follow ddp's losses under the sharding and splitting strategies."""

from __future__ import annotations

import pytest

from harness.ray_cluster import wait_for_state
from test_hf_models import hf_spec

pytestmark = pytest.mark.integration

USER_GPT2 = {"model": "examples.hf_user_model:build", "model_options": {"layers": 2, "width": 32, "seq_len": 32}}
# name: (the JobSpec, the name of the ddp run it must follow)
JOBS = {
    "gpt2-ddp": (hf_spec("gpt2", "ddp"), None),
    "gpt2-fsdp-zero3": (hf_spec("gpt2", "fsdp-zero3"), "gpt2-ddp"),
    "llama-ddp": (hf_spec("llama", "ddp"), None),
    "llama-tensor": (hf_spec("llama", "tensor"), "llama-ddp"),
    "user-gpt2-ddp": ({**hf_spec("gpt2", "ddp"), **USER_GPT2, "name": "user-gpt2-ddp"}, None),
    "user-gpt2-fsdp-zero3": ({**hf_spec("gpt2", "fsdp-zero3"), **USER_GPT2, "name": "user-gpt2-zero3"}, "user-gpt2-ddp"),
}


@pytest.fixture(scope="module")
def finished(ray_server) -> dict[str, list[dict]]:
    """Each job's per-step metric rows, as the metrics API serves them."""
    client = ray_server.client()
    ids = {name: client.submit(spec)["id"] for name, (spec, _) in JOBS.items()}
    rows = {}
    for name, job_id in ids.items():
        done = wait_for_state(client, job_id, {"SUCCEEDED", "FAILED", "CANCELLED"})
        assert done["state"] == "SUCCEEDED", (name, done["error"])
        rows[name] = [row for row in client.metrics(job_id)["items"] if row["loss"] is not None]
    return rows


@pytest.mark.parametrize("name", [name for name, (_, reference) in JOBS.items() if reference])
def test_follows_ddp_through_rest(finished: dict[str, list[dict]], name: str) -> None:
    reference = JOBS[name][1]
    assert len(finished[name]) == JOBS[name][0]["train"]["steps"]
    for field, tolerance in (("loss", {"abs": 1e-5}), ("grad_norm", {"rel": 1e-5})):
        values, expected = [row[field] for row in finished[name]], [row[field] for row in finished[reference]]
        assert values == pytest.approx(expected, **tolerance), (field, values, expected)
    assert all(row["grad_norm"] > 0 for row in finished[name])
