"""The planner's arithmetic: the seeds' worked examples exactly, the formulas it states, and the strategy it picks."""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction

import pytest

from ringmaster.service.errors import PlanError
from ringmaster.service.planner import (
    GB,
    PRECISIONS,
    Cluster,
    Layout,
    ModelSize,
    TransformerShape,
    Workload,
    activation_memory,
    builtin_model_size,
    communication,
    evaluate,
    pipeline_bubble,
    plan,
    ring_all_reduce_bytes,
    state_memory,
    tiny_gpt_parameters,
)

MIXED, FP32, BF16 = PRECISIONS["mixed"], PRECISIONS["fp32"], PRECISIONS["bf16"]
B = 10**9
# Shaped like a 7B Llama: 32 blocks, h = 4096, 32 heads, 2048 tokens.
LLAMA_7B = ModelSize(7 * B, TransformerShape(layers=32, hidden=4096, heads=32, seq_len=2048))


# --- the seeds' worked examples -----------------------------------------------------------------------------------


def test_seed_7b_mixed_precision_adam_is_112_gb_and_14_gb_per_gpu_under_zero3_over_8() -> None:
    assert MIXED.bytes_per_parameter == 16
    assert state_memory(7 * B, MIXED, Layout()).total == 112 * GB
    assert state_memory(7 * B, MIXED, Layout(dp=8, zero=3)).total == 14 * GB


def test_seed_13b_is_208_gb_and_52_gb_over_4_which_does_not_fit_40_gb() -> None:
    assert state_memory(13 * B, MIXED, Layout()).total == 208 * GB
    assert state_memory(13 * B, MIXED, Layout(dp=4, zero=3)).total == 52 * GB
    over_4 = evaluate(ModelSize(13 * B), Cluster(4, 4, 40 * GB), Workload(MIXED), "fsdp", "zero3", Layout(dp=4, zero=3))
    assert over_4.fits is False
    over_8 = evaluate(ModelSize(13 * B), Cluster(8, 8, 40 * GB), Workload(MIXED), "fsdp", "zero3", Layout(dp=8, zero=3))
    assert over_8.fits is True and over_8.memory == 26 * GB  # the seeds' answer: 8 GPUs, 26 GB each


def test_seed_pipeline_bubbles_are_exact_fractions() -> None:
    assert pipeline_bubble(4, 8) == Fraction(3, 11)
    assert pipeline_bubble(6, 24) == Fraction(5, 29)
    assert pipeline_bubble(4, 16) == Fraction(3, 19)  # doubling m shrinks it (active recall 4)


def test_seed_ring_all_reduce_volume_per_gpu() -> None:
    assert ring_all_reduce_bytes(1 * GB, 8) == 1.75 * GB
    assert ring_all_reduce_bytes(2 * GB, 16) == 3.75 * GB


# --- bytes per parameter and sharding ------------------------------------------------------------------------------


def test_fp32_and_ringmasters_bf16_autocast_hold_4_4_8_while_mixed_holds_2_2_12() -> None:
    assert (FP32.parameter_bytes, FP32.gradient_bytes, FP32.optimizer_bytes) == (4, 4, 8)
    assert (BF16.parameter_bytes, BF16.gradient_bytes, BF16.optimizer_bytes) == (4, 4, 8)
    assert (MIXED.parameter_bytes, MIXED.gradient_bytes, MIXED.optimizer_bytes) == (2, 2, 12)


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        (Layout(dp=8), (4, 4, 8)),
        (Layout(dp=8, zero=1), (4, 4, 1)),
        (Layout(dp=8, zero=2), (4, 0.5, 1)),
        (Layout(dp=8, zero=3), (0.5, 0.5, 1)),
        (Layout(dp=2, tp=4), (1, 1, 2)),
        (Layout(dp=2, pp=4), (1, 1, 2)),
        (Layout(dp=2, tp=2, pp=2, zero=3), (0.5, 0.5, 1)),
        (Layout(dp=8, zero=3, shard_group=4), (1, 1, 2)),  # hybrid: sharded in groups of 4, replicated across
    ],
)
def test_zero_stages_shard_what_they_shard_and_tp_pp_divide_everything(
    layout: Layout, expected: tuple[float, ...]
) -> None:
    state = state_memory(1000, FP32, layout)
    assert (state.parameters / 1000, state.gradients / 1000, state.optimizer / 1000) == expected


def test_zero1_shards_the_fp32_master_copy_with_the_moments_under_mixed_precision() -> None:
    assert state_memory(7 * B, MIXED, Layout(dp=8, zero=1)).total == (2 + 2 + 12 / 8) * 7 * B
    assert state_memory(7 * B, FP32, Layout(dp=8, zero=1)).total == (4 + 4 + 8 / 8) * 7 * B


# --- activations, traffic -------------------------------------------------------------------------------------------


def test_activations_follow_korthikanti_per_layer_formula() -> None:
    one_layer = TransformerShape(layers=1, hidden=4096, heads=32, seq_len=2048)
    workload = Workload(MIXED, micro_batch_size=1)
    s, b, h, a = 2048, 1, 4096, 32
    assert activation_memory(one_layer, workload, Layout()) == s * b * h * (34 + 5 * a * s / h)
    assert activation_memory(one_layer, workload, Layout(tp=8)) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert activation_memory(one_layer, Workload(FP32, micro_batch_size=1), Layout()) == 2 * s * b * h * (
        34 + 5 * a * s / h
    )
    assert activation_memory(one_layer, Workload(MIXED), Layout()) is None  # no micro-batch size, no estimate


def test_pipeline_stage_holds_its_layers_for_the_microbatches_in_flight() -> None:
    shape = LLAMA_7B.shape
    assert shape is not None
    whole = activation_memory(shape, Workload(MIXED, micro_batch_size=1), Layout())
    one_f_one_b = activation_memory(
        shape, Workload(MIXED, micro_batch_size=1, microbatches=8, schedule="1f1b"), Layout(pp=4)
    )
    gpipe = activation_memory(
        shape, Workload(MIXED, micro_batch_size=1, microbatches=8, schedule="gpipe"), Layout(pp=4)
    )
    assert one_f_one_b == whole  # L/p layers × p micro-batches (Korthikanti §4.2.3)
    assert gpipe == 2 * whole  # L/p layers × all m = 8 micro-batches


def test_zero1_and_zero2_move_what_ddp_moves_and_zero3_moves_one_and_a_half_times() -> None:
    workload = Workload(MIXED)
    ddp = communication(ModelSize(7 * B), workload, Layout(dp=8)).data_parallel
    assert ddp == ring_all_reduce_bytes(7 * B * 2, 8) == 24.5 * GB
    assert communication(ModelSize(7 * B), workload, Layout(dp=8, zero=1)).data_parallel == ddp
    assert communication(ModelSize(7 * B), workload, Layout(dp=8, zero=2)).data_parallel == ddp
    assert communication(ModelSize(7 * B), workload, Layout(dp=8, zero=3)).data_parallel == 1.5 * ddp


def test_tensor_parallel_sends_four_all_reduces_per_block_and_pipeline_two_activations_per_microbatch() -> None:
    model = ModelSize(10**6, TransformerShape(layers=4, hidden=64, heads=4, seq_len=16))
    workload = Workload(FP32, micro_batch_size=2, microbatches=8)
    activation = 2 * 16 * 64 * 4
    tensor = communication(model, workload, Layout(tp=2))
    assert tensor.tensor_parallel == 4 * 4 * ring_all_reduce_bytes(activation, 2) and tensor.pipeline == 0
    pipeline = communication(model, workload, Layout(pp=4))
    assert pipeline.pipeline == 2 * 8 * activation and pipeline.tensor_parallel == 0
    assert communication(ModelSize(10**6), workload, Layout(tp=2)).tensor_parallel is None  # shape unknown


# --- model size ----------------------------------------------------------------------------------------------------


def test_tiny_gpt_defaults_count_by_formula() -> None:
    # 2·256·64 (token table + head) + 64·64 (positions) + 2·(12·64² + 4·64) (blocks) + 2·64 (final norm)
    assert tiny_gpt_parameters(n_layers=2, n_heads=4, dim=64, seq_len=64, vocab=256) == 135_808
    size = builtin_model_size("tiny-gpt", {"max_corpus_bytes": 1000})
    assert size.parameters == 135_808 and size.shape == TransformerShape(layers=2, hidden=64, heads=4, seq_len=64)


@pytest.mark.parametrize(
    ("name", "options", "field", "needle"),
    [
        ("tiny-gpt", {"n_layer": 4}, "model_options.n_layer", "has no option 'n_layer'"),
        ("tiny-gpt", {"dim": 65}, "model_options.dim", "divisible by n_heads"),
        ("tiny-gpt", {"dim": "big"}, "model_options.dim", "must be an integer"),
        ("mlp", {"depth": -1}, "model_options.depth", "≥ 0"),
        ("resnet", {}, "model", "must be a built-in"),
    ],
)
def test_builtin_size_options_are_checked(name: str, options: dict, field: str, needle: str) -> None:
    with pytest.raises(PlanError, match=needle) as raised:
        builtin_model_size(name, options)
    assert raised.value.field == field


# --- selection ------------------------------------------------------------------------------------------------------


def _pick(
    model: ModelSize, gpus_per_node: int, nodes: int, gpu_gb: float, micro_batch_size: int | None = None
) -> str | None:
    chosen = plan(
        model, Cluster(gpus_per_node * nodes, gpus_per_node, gpu_gb * GB), Workload(MIXED, micro_batch_size)
    ).recommendation
    return None if chosen is None else chosen.label


@pytest.mark.parametrize(
    ("model", "gpus_per_node", "nodes", "gpu_gb", "micro_batch_size", "expected"),
    [
        (ModelSize(1 * B), 8, 1, 80, None, "ddp (dp=8)"),  # 16 GB fits one GPU: DDP
        (ModelSize(7 * B), 8, 1, 80, None, "zero1 (dp=8)"),  # 112 GB does not; sharding the optimizer is enough
        (ModelSize(7 * B), 8, 1, 32, None, "fsdp zero2 (dp=8)"),  # 38.5 GB > 32; 26.25 GB fits
        (ModelSize(7 * B), 8, 1, 24, None, "fsdp zero3 (dp=8)"),  # only full sharding: 14 GB
        (ModelSize(13 * B), 8, 1, 40, None, "fsdp zero3 (dp=8)"),  # the seeds' answer: 26 GB each
        (ModelSize(13 * B), 4, 1, 40, None, None),  # 52 GB over 4: nothing fits
        (ModelSize(13 * B), 8, 2, 40, None, "fsdp zero2 (dp=16)"),  # 2 + 14/16 B/param = 37.4 GB
        (LLAMA_7B, 8, 1, 80, 1, "zero1 (dp=8)"),  # 38.5 GB state + 30.6 GB activations
        (LLAMA_7B, 8, 1, 24, 1, "tensor (dp=1, tp=8)"),  # ZeRO-3 leaves 30.6 GB of activations; TP splits them
        (LLAMA_7B, 4, 2, 24, 1, "3d zero3 (dp=2, tp=4)"),  # TP capped at a node's 4 GPUs; ZeRO-3 across the 2 nodes
        (LLAMA_7B, 8, 1, 24, 64, None),  # activations of 64 sequences fit nowhere
    ],
)
def test_selection_table(
    model: ModelSize, gpus_per_node: int, nodes: int, gpu_gb: float, micro_batch_size: int | None, expected: str | None
) -> None:
    assert _pick(model, gpus_per_node, nodes, gpu_gb, micro_batch_size) == expected


def test_tensor_parallel_never_spans_nodes_and_hybrid_appears_with_several_nodes() -> None:
    table = plan(LLAMA_7B, Cluster(8, 4, 24 * GB), Workload(MIXED, 1)).options
    assert max(option.layout.tp for option in table) == 4
    assert any(option.shard == "hybrid" and option.layout.shards == 4 for option in table)
    assert not any(option.shard == "hybrid" for option in plan(LLAMA_7B, Cluster(8, 8), Workload(MIXED)).options)


def test_options_are_ordered_cheapest_first_and_each_has_reasons() -> None:
    result = plan(ModelSize(7 * B), Cluster(8, 8, 80 * GB), Workload(MIXED))
    labels = [option.label for option in result.options]
    assert labels[:4] == ["ddp (dp=8)", "zero1 (dp=8)", "fsdp zero2 (dp=8)", "fsdp zero3 (dp=8)"]
    assert (
        labels.index("tensor (dp=4, tp=2)")
        < labels.index("pipeline (dp=4, pp=2)")
        < labels.index("3d zero3 (dp=4, tp=2)")
    )
    assert all(option.reasons and "GB per GPU" in option.reasons[0] for option in result.options)
    assert result.reasons[0] == "does not fit on one GPU: DDP needs 112.00 GB > 80.00 GB"
    assert result.reasons[1] == "cheapest that fits: zero1 (dp=8), 38.50 GB per GPU"


def test_when_nothing_fits_the_reasons_say_what_would() -> None:
    result = plan(ModelSize(13 * B), Cluster(4, 4, 40 * GB), Workload(MIXED))
    assert result.recommendation is None
    assert "the least memory is fsdp zero3 (dp=4) with 52.00 GB per GPU" in result.reasons[1]
    assert "fsdp zero3 over 6 GPUs fits (34.67 GB per GPU)" in result.reasons
    assert "or GPUs with at least 52.00 GB (fsdp zero3 over 4)" in result.reasons


@pytest.mark.parametrize(
    "modules",
    [
        "ringmaster.service.planner",
        "ringmaster.service.planner, ringmaster.service.job_plan, ringmaster.cli.app, ringmaster.api.app",
    ],
)
def test_the_planner_and_the_control_plane_import_neither_torch_nor_ray(modules: str) -> None:
    code = f"import sys, {modules}; assert not {{'torch', 'ray'}} & {{m.split('.')[0] for m in sys.modules}}"
    subprocess.run([sys.executable, "-c", code], check=True)
