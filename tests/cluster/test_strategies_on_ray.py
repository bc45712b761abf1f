"""Every parallelism strategy through the real job path (REST → queue → gang admission → Ray job →
workers) trains tiny-gpt to the per-step losses and weights of one process on the same global batches,
and every rank reports its measured state memory.

All jobs are submitted at once so the cluster runs two at a time; each test then waits for its own. zero1, fsdp
zero3, pipeline 1F1B and the 2x2 3d layout are checked the same way, with a node killed mid-run, in
tests/cluster/test_memory_recovery_on_ray.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from harness.checkpoints import load_model_weights
from harness.local_control_plane import wait_for_state
from ringmaster.service.client import RingmasterClient
from ringmaster.service.spec import JobSpec
from ringmaster.workers.models import build_bundle
from tests.support.strategy_reference import ReferenceRun, strategy_spec, train_reference

pytestmark = pytest.mark.integration

STEPS = 4
FP32_TOLERANCE = 1e-5
# bf16 keeps 8 significant bits (rounding 2^-9 ≈ 2e-3 relative per operation), but the logged loss is an
# fp32 mean over 512 tokens, which averages those errors down: over these 4 steps FSDP (which casts every
# parameter, norms included) strayed at most 4e-4 from the fp32 reference and autocast at most 2e-4.
# 1e-3 keeps 2.5x margin, yet a run whose steps trained on only half their batch is 3.5e-3 off by
# step 4, and one on the wrong samples 2.8e-2 off at step 2, so the test still fails on real mistakes.
BF16_TOLERANCE = 1e-3

# name: (strategy, workers, micro_batch_size, precision, parallel). Global batch 16 everywhere; every case
# accumulates at least two micro-steps per optimizer step.
CASES = {
    "fsdp-zero2": ("fsdp", 2, 4, "fp32", {"shard": "zero2"}),
    "fsdp-zero3-bf16": ("fsdp", 2, 4, "bf16", {"shard": "zero3"}),
    "pipeline-gpipe": ("pipeline", 2, 2, "fp32", {"pp": 2, "microbatches": 4, "schedule": "gpipe"}),
    "pipeline-1f1b-bf16": ("pipeline", 2, 2, "bf16", {"pp": 2, "microbatches": 4, "schedule": "1f1b"}),
    "pipeline-interleaved1f1b": (
        "pipeline",
        2,
        2,
        "fp32",
        {"pp": 2, "microbatches": 4, "schedule": "interleaved1f1b", "stages_per_rank": 2},
    ),
    "tensor": ("tensor", 2, 4, "fp32", {"tp": 2}),
}
# Strategies whose ranks hold disjoint pieces of the parameters: their fp32 shards add up to the model.
PARTITIONED = {"fsdp-zero2", "pipeline-gpipe", "pipeline-interleaved1f1b"}


def _spec(name: str) -> dict:
    strategy, workers, micro_batch_size, precision, parallel = CASES[name]
    return strategy_spec(
        f"strategy-{name}", strategy, workers, STEPS, micro_batch_size, precision=precision, **parallel
    )


@pytest.fixture(scope="module")
def submitted(ray_server) -> dict[str, str]:
    client = ray_server.client()
    return {name: client.submit(_spec(name))["id"] for name in CASES}


@pytest.fixture(scope="module")
def reference() -> ReferenceRun:
    return train_reference(STEPS)


@pytest.mark.parametrize("name", list(CASES))
def test_strategy_matches_single_process_and_reports_every_rank_memory(
    name: str, submitted: dict[str, str], reference: ReferenceRun, client: RingmasterClient
) -> None:
    job_id = submitted[name]
    done = wait_for_state(client, job_id, {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert done["state"] == "SUCCEEDED", done["error"]
    _strategy, workers, _, precision, _ = CASES[name]

    metrics = client.metrics(job_id)
    rows = metrics["items"]
    losses = [row["loss"] for row in rows if row["loss"] is not None]
    tolerance = FP32_TOLERANCE if precision == "fp32" else BF16_TOLERANCE
    assert losses == pytest.approx(reference.losses, abs=tolerance), f"{name} losses {losses} vs {reference.losses}"
    assert all(row["world_size"] == workers for row in rows)
    assert math.isfinite(rows[-1]["val_loss"])

    final = Path(client.checkpoints(job_id)["items"][-1]["uri"])
    trained = build_bundle(JobSpec.model_validate(_spec(name))).model
    load_model_weights(final, trained)  # unsplit FQNs: a plain module loads any strategy's shards
    if precision == "fp32":
        for key, expected in reference.state.items():
            torch.testing.assert_close(
                trained.state_dict()[key], expected, rtol=0, atol=FP32_TOLERANCE, msg=lambda m, key=key: f"{key}: {m}"
            )

    memory = metrics["memory"]
    assert sorted(entry["rank"] for entry in memory) == list(range(workers)), "every rank reports its memory once"
    parameter_count = sum(t.numel() for t in reference.state.values())
    assert all(entry["parameter_count"] == parameter_count and entry["measured"]["total_bytes"] > 0 for entry in memory)
    if name in PARTITIONED:
        assert sum(entry["measured"]["parameters_bytes"] for entry in memory) == 4 * parameter_count


def test_hybrid_shard_on_one_node_fails_with_the_reason_instead_of_falling_back(client: RingmasterClient) -> None:
    """The shared cluster is one Ray node; hybrid numerics across two (fake) nodes are in test_hybrid_shard.py."""
    job = client.submit(strategy_spec("strategy-hybrid-one-node", "fsdp", 2, STEPS, 4, shard="hybrid"))
    done = wait_for_state(client, job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert done["state"] == "FAILED"
    assert "replicates across nodes, but all 2 workers are on one node" in done["error"], done["error"]
