"""The parallelism planner: per-GPU memory, communication per step and pipeline bubble, by arithmetic alone.

It lets the control plane pick and check a strategy at submit without torch, and lets workers and
benchmarks compare what they measure with what was predicted. Sizes are bytes; GB means 10⁹ bytes,
as in the seeds. Sources of the formulas:

- training state: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models" (SC20), §3 and §5: mixed-precision Adam holds 2 + 2 + 12 = 16 bytes/parameter;
  stage 1 shards the optimizer state (the 12), stage 2 also the gradients, stage 3 also the parameters.
- activations: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
  (2022), eq. 1-2 and §4.2.3.
- ring all-reduce: Patarasuk & Yuan (2009): 2(N−1)/N·S bytes sent per GPU; ZeRO §7: stages 1-2 move
  as much as DDP, stage 3 1.5× (an all-gather in forward and one in backward, one reduce-scatter).
- tensor parallelism: Shoeybi et al., "Megatron-LM" (2019), §3: two all-reduces of the b·s·h
  activations per transformer block in forward, two in backward.
- pipeline: Huang et al., "GPipe" (2019): bubble (p−1)/(p+m−1); Narayanan et al. (SC21) for the
  interleaved schedule, (p−1)/(v·m+p−1) with v model chunks per rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from itertools import pairwise
from typing import Any

from ringmaster.service.catalogue import BUILTIN_MODELS, STRATEGIES
from ringmaster.service.errors import VALUE_CONFLICT, PlanError

GB = 10**9

# ---------------------------------------------------------------------------------------------
# Bytes per parameter


@dataclass(frozen=True)
class Precision:
    """Bytes each parameter costs in training state, and bytes per activation element sent between ranks."""

    name: str
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    description: str

    @property
    def bytes_per_parameter(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


# The "12 (or as computed) for fp32" counts fp32 parameters and Adam's two moments (4 + 8) but
# not the gradients; AdamW training holds those too, so fp32 costs 4 + 4 + 8 = 16, as computed here.
PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(
        "fp32", 4, 4, 8, 4, "fp32 parameters and gradients, AdamW's two fp32 moments: 4 + 4 + 8 = 16 bytes/parameter"
    ),
    "bf16": Precision(
        "bf16",
        4,
        4,
        8,
        2,
        "ringmaster's train.precision bf16: computes in bf16 (autocast, or FSDP's mixed-precision policy) while "
        "parameters, gradients and AdamW's moments stay fp32: 4 + 4 + 8 = 16 bytes/parameter; activations are 16-bit",
    ),
    "mixed": Precision(
        "mixed",
        2,
        2,
        12,
        2,
        "mixed-precision Adam (the ZeRO paper and the seeds): bf16 parameters and gradients, an fp32 master copy "
        "and two fp32 moments: 2 + 2 + (4 + 8) = 16 bytes/parameter, of which ZeRO-1 shards the optimizer's 12",
    ),
}


# ---------------------------------------------------------------------------------------------
# Model size


@dataclass(frozen=True)
class TransformerShape:
    """What activations and tensor/pipeline traffic depend on: layers L, hidden size h, heads a, sequence s."""

    layers: int
    hidden: int
    heads: int
    seq_len: int


@dataclass(frozen=True)
class ModelSize:
    parameters: int
    shape: TransformerShape | None = None
    description: str = ""


def tiny_gpt_parameters(n_layers: int, n_heads: int, dim: int, seq_len: int, vocab: int) -> int:
    """Parameters of workers/models/tiny_gpt.py: untied token table and head, a position table, L blocks, a norm.

    Per block: wq, wk, wv, wo (4·d²) + MLP d→4d→d without bias (8·d²) + two LayerNorms (2·2d).
    n_heads splits d without changing the count.
    """
    del n_heads
    return 2 * vocab * dim + seq_len * dim + n_layers * (12 * dim * dim + 4 * dim) + 2 * dim


def mlp_parameters(in_dim: int, hidden: int, out_dim: int, depth: int) -> int:
    """Parameters of workers/models/mlp.py: ``depth`` biased hidden layers, then a biased output layer."""
    widths = [in_dim] + [hidden] * depth
    return sum(a * b + b for a, b in pairwise(widths)) + widths[-1] * out_dim + out_dim


def builtin_model_size(name: str, options: Mapping[str, Any]) -> ModelSize:
    """A built-in's size from its model_options, so a job on a built-in never has to state it."""
    if name not in BUILTIN_MODELS:
        raise PlanError(
            f"model must be a built-in ({', '.join(BUILTIN_MODELS)}), got {name!r}; size any other model (your "
            "own, an hf: one) by its parameters instead, with layers, hidden, heads and seq_len for its "
            "activations and traffic",
            field="model",
        )
    builtin = BUILTIN_MODELS[name]
    defaults, data_options = builtin.size_defaults, builtin.data_options
    unknown = sorted(set(options) - set(defaults) - set(data_options))
    if unknown:
        accepted = ", ".join([*defaults, *data_options])
        raise PlanError(
            f"{name} has no option {unknown[0]!r}; its options are {accepted}", field=f"model_options.{unknown[0]}"
        )
    size: dict[str, int] = {}
    options = builtin.whole_sizes(dict(options))  # 28.0 is a JSON integer
    for key, default in defaults.items():
        value = options.get(key, default)
        lowest = builtin.lowest(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise PlanError(
                f"{name} option {key} must be an integer ≥ {lowest}, got {value!r}", field=f"model_options.{key}"
            )
        size[key] = value
    if name == "mlp":
        return ModelSize(mlp_parameters(**size), None, f"mlp({_options_text(size)})")
    if size["dim"] % size["n_heads"]:
        raise PlanError(
            f"tiny-gpt: dim ({size['dim']}) must be divisible by n_heads ({size['n_heads']})",
            field="model_options.dim",
            kind=VALUE_CONFLICT,
        )
    shape = TransformerShape(
        layers=size["n_layers"], hidden=size["dim"], heads=size["n_heads"], seq_len=size["seq_len"]
    )
    return ModelSize(tiny_gpt_parameters(**size), shape, f"tiny-gpt({_options_text(size)})")


def _options_text(options: Mapping[str, int]) -> str:
    return ", ".join(f"{key}={value}" for key, value in options.items())


# ---------------------------------------------------------------------------------------------
# Memory per GPU


@dataclass(frozen=True)
class Layout:
    """How the ranks split the model: data-parallel replicas × pipeline stages × tensor shards, and the ZeRO stage.

    ``shard_group`` (hybrid sharding) shards within groups of that many data-parallel ranks and replicates
    across the groups; None shards over all ``dp``.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    shard_group: int | None = None

    @property
    def shards(self) -> int:
        return self.shard_group or self.dp


@dataclass(frozen=True)
class StateMemory:
    """Bytes of parameters, gradients and optimizer state one GPU holds."""

    parameters: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


def state_memory(parameters: int, prec: Precision, layout: Layout) -> StateMemory:
    """ZeRO §5: stage ≥ 1 divides the optimizer state by the shards, ≥ 2 the gradients, 3 the parameters; TP and PP
    divide all.

    Assumes an even split over tensor shards and pipeline stages (embeddings and norms are counted as split too).
    """
    split = layout.tp * layout.pp
    shards = layout.shards

    def share(bytes_per_parameter: int, stage: int) -> float:
        return parameters * bytes_per_parameter / (split * (shards if layout.zero >= stage else 1))

    return StateMemory(share(prec.parameter_bytes, 3), share(prec.gradient_bytes, 2), share(prec.optimizer_bytes, 1))


@dataclass(frozen=True)
class Workload:
    """What a step runs: the precision, micro-batch size (sequences), pipeline micro-batches and schedule."""

    precision: Precision
    micro_batch_size: int | None = None
    microbatches: int = 8
    schedule: str = "1f1b"
    stages_per_rank: int = 2


def activation_memory(shape: TransformerShape, workload: Workload, layout: Layout) -> float | None:
    """Activations stored for backward, per GPU (Korthikanti et al. 2022).

    Per layer and micro-batch, 16-bit, no recomputation, no sequence parallelism (eq. 2; eq. 1 at t = 1):
    s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes. fp32 activations double it (the 1-byte dropout masks are doubled too,
    which overestimates slightly). Ignores the embedding and logits. Fused attention (flash / memory-efficient
    SDPA) does not keep the 5·a·s/h score term, so this is an upper bound there.
    A pipeline stage holds ⌈L/p⌉ layers for the micro-batches in flight (§4.2.3): m under GPipe, min(p, m) under
    1F1B, and min(p, m)·(1 + (p−1)/(p·v)) under the interleaved schedule.
    """
    if workload.micro_batch_size is None:
        return None
    s, b, h, a, t = shape.seq_len, workload.micro_batch_size, shape.hidden, shape.heads, layout.tp
    per_layer = s * b * (10 * h + 24 * h / t + 5 * a * s / t) * workload.precision.activation_bytes / 2
    layers = math.ceil(shape.layers / layout.pp)
    return per_layer * layers * in_flight_microbatches(workload, layout.pp)


def in_flight_microbatches(workload: Workload, pp: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once (1 without a pipeline)."""
    if pp == 1:
        return 1
    m = workload.microbatches
    if workload.schedule == "gpipe":
        return m
    if workload.schedule == "interleaved1f1b":
        return min(pp, m) * (1 + (pp - 1) / (pp * workload.stages_per_rank))
    return min(pp, m)


# ---------------------------------------------------------------------------------------------
# Communication and bubble


def ring_all_reduce_bytes(size: float, n: int) -> float:
    """Bytes each of n GPUs sends in a ring all-reduce of ``size`` bytes: reduce-scatter then all-gather, 2(N−1)/N·S."""
    return 2 * (n - 1) * size / n


def ring_all_gather_bytes(size: float, n: int) -> float:
    """Bytes each GPU sends to all-gather (or reduce-scatter) a ``size``-byte tensor over n GPUs: (N−1)/N·S."""
    return (n - 1) * size / n


def pipeline_bubble(p: int, m: int, v: int = 1) -> Fraction:
    """Idle share of each stage's time: (p−1)/(p+m−1) for GPipe and 1F1B; (p−1)/(v·m+p−1) interleaved over v chunks."""
    return Fraction(p - 1, v * m + p - 1)


@dataclass(frozen=True)
class Communication:
    """Bytes one GPU sends per step, by parallel axis; None where the transformer's shape or batch is unknown."""

    data_parallel: float
    tensor_parallel: float | None
    pipeline: float | None

    @property
    def total(self) -> float | None:
        if self.tensor_parallel is None or self.pipeline is None:
            return None
        return self.data_parallel + self.tensor_parallel + self.pipeline


def communication(model: ModelSize, workload: Workload, layout: Layout) -> Communication:
    """Per step: one optimizer step without gradient accumulation (one micro-batch per replica, or m through a
    pipeline).

    Data parallel: DDP, ZeRO-1 and ZeRO-2 send 2(N−1)/N·S of gradients (ZeRO-1/2 as a reduce-scatter plus an
    all-gather of the same volume); ZeRO-3 adds a parameter all-gather in forward and one in backward per
    micro-batch, 3(N−1)/N·S for one (1.5× DDP); hybrid does that within its shard group and all-reduces the
    gradient shard across groups. Tensor: 4 all-reduces of b·s·h per block and micro-batch. Pipeline: the
    busiest stage sends each micro-batch's activation forward and its gradient backward, b·s·h each.
    Gradient accumulation multiplies the tensor traffic and ZeRO-3's all-gathers by the micro-steps, not DDP's.
    """
    prec, split = workload.precision, layout.tp * layout.pp
    gradients = model.parameters * prec.gradient_bytes / split
    microbatches = workload.microbatches if layout.pp > 1 else 1
    if layout.zero >= 3 and layout.dp > 1:
        group, replicas = layout.shards, layout.dp // layout.shards
        gathers = 2 * microbatches * ring_all_gather_bytes(model.parameters * prec.parameter_bytes / split, group)
        data_parallel = (
            gathers + ring_all_gather_bytes(gradients, group) + ring_all_reduce_bytes(gradients / group, replicas)
        )
    else:
        data_parallel = ring_all_reduce_bytes(gradients, layout.dp)
    tensor = pipeline = None
    if model.shape is not None and workload.micro_batch_size is not None:
        activation = workload.micro_batch_size * model.shape.seq_len * model.shape.hidden * prec.activation_bytes
        layers = math.ceil(model.shape.layers / layout.pp)
        tensor = 4 * layers * microbatches * ring_all_reduce_bytes(activation, layout.tp)
        pipeline = (2 if layout.pp > 2 else 1) * microbatches * activation
    return Communication(data_parallel, 0.0 if layout.tp == 1 else tensor, 0.0 if layout.pp == 1 else pipeline)


# ---------------------------------------------------------------------------------------------
# Options and the pick


@dataclass(frozen=True)
class Cluster:
    """Where the job runs: ranks (one GPU each), ranks per node (None: unknown), memory per GPU (None: no fit check)."""

    world_size: int
    gpus_per_node: int | None = None
    gpu_memory: float | None = None


@dataclass(frozen=True)
class Option:
    """One way to run the model on the cluster, with what it is predicted to cost."""

    strategy: str
    shard: str | None
    layout: Layout
    state: StateMemory
    activations: float | None
    communication: Communication
    bubble: Fraction | None
    fits: bool | None
    reasons: tuple[str, ...]

    @property
    def memory(self) -> float:
        """Bytes per GPU: training state plus activations where they are known."""
        return self.state.total + (self.activations or 0.0)

    def spec_fields(self) -> dict[str, Any]:
        """The JobSpec ``strategy`` and ``parallel`` settings that run this option."""
        parallel: dict[str, Any] = {"tp": self.layout.tp, "pp": self.layout.pp}
        if self.shard is not None:
            parallel["shard"] = self.shard
        return {"strategy": self.strategy, "parallel": parallel}

    @property
    def label(self) -> str:
        layout, parts = self.layout, [self.strategy]
        if self.shard and (layout.dp > 1 or self.strategy == "fsdp"):
            parts.append(self.shard)
        dims = [
            f"{name}={value}"
            for name, value in (("dp", layout.dp), ("tp", layout.tp), ("pp", layout.pp))
            if value > 1 or name == "dp"
        ]
        return f"{' '.join(parts)} ({', '.join(dims)})"


# Cost tiers in the order the selection prefers them, following the seeds: DDP when the model fits; otherwise
# data-parallel-style sharding first (ZeRO-1/2 move no more than DDP; hybrid keeps ZeRO-3's all-gathers inside
# a node; ZeRO-3 moves 1.5×), then tensor parallelism (an all-reduce in every block, so only inside a node), then
# pipelines (idle bubble), then their 3-D composition. Within a tier, fewer model-parallel splits first.
_TIERS = {
    ("ddp", None): 0,
    ("zero1", None): 1,
    ("fsdp", "zero2"): 2,
    ("fsdp", "hybrid"): 3,
    ("fsdp", "zero3"): 4,
    ("tensor", None): 5,
    ("pipeline", None): 6,
    ("3d", "zero3"): 7,
}


def strategy_zero_stage(strategy: str, shard: str | None) -> int:
    """The ZeRO stage a JobSpec strategy runs its data-parallel axis at."""
    return STRATEGIES[strategy].zero_stage(shard)


def evaluate(
    model: ModelSize, cluster: Cluster, workload: Workload, strategy: str, shard: str | None, layout: Layout
) -> Option:
    """Predict one option's memory, traffic and bubble, and whether it fits the GPU."""
    state = state_memory(model.parameters, workload.precision, layout)
    activations = activation_memory(model.shape, workload, layout) if model.shape else None
    traffic = communication(model, workload, layout)
    v = workload.stages_per_rank if workload.schedule == "interleaved1f1b" else 1
    bubble = pipeline_bubble(layout.pp, workload.microbatches, v) if layout.pp > 1 else None
    total = state.total + (activations or 0.0)
    fits = None if cluster.gpu_memory is None else total <= cluster.gpu_memory
    reasons = [_memory_reason(state, activations, cluster.gpu_memory)]
    reasons += _strategy_reasons(strategy, shard, layout, cluster, workload, traffic, bubble)
    return Option(strategy, shard, layout, state, activations, traffic, bubble, fits, tuple(reasons))


def _memory_reason(state: StateMemory, activations: float | None, gpu_memory: float | None) -> str:
    parts = (
        f"parameters {format_bytes(state.parameters)} + gradients {format_bytes(state.gradients)}"
        f" + optimizer {format_bytes(state.optimizer)}"
    )
    if activations is not None:
        parts += f" + activations {format_bytes(activations)}"
    total = state.total + (activations or 0.0)
    text = f"{format_bytes(total)} per GPU ({parts})"
    if gpu_memory is None:
        return text
    return f"{text} {'≤' if total <= gpu_memory else '>'} {format_bytes(gpu_memory)}"


def _strategy_reasons(
    strategy: str,
    shard: str | None,
    layout: Layout,
    cluster: Cluster,
    workload: Workload,
    traffic: Communication,
    bubble: Fraction | None,
) -> list[str]:
    reasons = []
    dp_traffic = f"{format_bytes(traffic.data_parallel)} per GPU per step"
    if strategy == "ddp":
        reasons.append(f"replicates everything; one gradient all-reduce per step, 2(N−1)/N·S = {dp_traffic}")
    elif strategy == "zero1":
        reasons.append(f"shards optimizer state over {layout.dp}; same traffic as DDP ({dp_traffic})")
    elif layout.dp > 1 and shard == "zero2":
        reasons.append(f"shards optimizer state and gradients over {layout.dp}; same traffic as DDP ({dp_traffic})")
    elif layout.dp > 1 and shard == "hybrid":
        reasons.append(
            f"ZeRO-3 within groups of {layout.shards} GPUs on a node, replicated across {layout.dp // layout.shards}; "
            f"the all-gathers stay inside a node ({dp_traffic})"
        )
    elif layout.dp > 1 and shard == "zero3":
        reasons.append(
            f"shards parameters, gradients and optimizer state over {layout.dp}; all-gathers parameters in "
            f"forward and backward of each micro-batch, 1.5× DDP's traffic for one ({dp_traffic})"
        )
    if layout.tp > 1 and cluster.gpus_per_node is not None:
        reasons.append(
            f"tp={layout.tp} ≤ {cluster.gpus_per_node} GPUs per node: its all-reduces in every block stay on a node's "
            "links"
        )
    if bubble is not None:
        formula = "(p−1)/(v·m+p−1)" if workload.schedule == "interleaved1f1b" else "(p−1)/(p+m−1)"
        chunks = f", v={workload.stages_per_rank}" if workload.schedule == "interleaved1f1b" else ""
        reasons.append(
            f"pipeline bubble {formula} with p={layout.pp}, m={workload.microbatches}{chunks}: "
            f"{bubble.numerator}/{bubble.denominator} = {float(bubble):.1%} idle"
        )
    return reasons


def options(model: ModelSize, cluster: Cluster, workload: Workload) -> list[Option]:
    """Every strategy the cluster can run, cheapest first (see _TIERS); tensor-parallel groups never span nodes."""
    n, per_node = cluster.world_size, cluster.gpus_per_node
    shape = model.shape
    candidates: list[tuple[str, str | None, Layout]] = [("ddp", None, Layout(dp=n))]
    if n > 1:
        candidates += [("zero1", None, Layout(dp=n, zero=1)), ("fsdp", "zero2", Layout(dp=n, zero=2))]
        if per_node is not None and 1 < per_node < n and n % per_node == 0:
            candidates.append(("fsdp", "hybrid", Layout(dp=n, zero=3, shard_group=per_node)))
        candidates.append(("fsdp", "zero3", Layout(dp=n, zero=3)))
    tps = [t for t in _divisors(per_node or 1) if t > 1 and n % t == 0 and (shape is None or shape.heads % t == 0)]
    pps = [p for p in _divisors(n) if p > 1 and (shape is None or p <= shape.layers)]
    candidates += [("tensor", None, Layout(dp=n // t, tp=t)) for t in tps]
    candidates += [("pipeline", None, Layout(dp=n // p, pp=p)) for p in pps]
    for t in [1, *tps]:
        for p in [1, *pps]:
            dp = n // (t * p) if n % (t * p) == 0 else 0
            if dp and t * p > 1 and (dp > 1 or (t > 1 and p > 1)):
                candidates.append(("3d", "zero3", Layout(dp=dp, tp=t, pp=p, zero=3 if dp > 1 else 0)))
    evaluated = [evaluate(model, cluster, workload, strategy, shard, layout) for strategy, shard, layout in candidates]
    return sorted(evaluated, key=lambda o: (_TIERS[(o.strategy, o.shard)], o.layout.tp * o.layout.pp, o.layout.pp))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Plan:
    model: ModelSize
    cluster: Cluster
    workload: Workload
    options: list[Option]
    recommendation: Option | None
    reasons: tuple[str, ...]


def plan(model: ModelSize, cluster: Cluster, workload: Workload) -> Plan:
    """The options table and the pick: DDP when the model fits one GPU, else the cheapest option that fits."""
    table = options(model, cluster, workload)
    choice, reasons = recommend(table, model, cluster, workload)
    return Plan(model, cluster, workload, table, choice, reasons)


def recommend(
    table: list[Option], model: ModelSize, cluster: Cluster, workload: Workload
) -> tuple[Option | None, tuple[str, ...]]:
    """The seeds' selection table: fits on one GPU → DDP; too large → the cheapest option that fits, with why."""
    ddp, gpu_memory = table[0], format_bytes(cluster.gpu_memory or 0)
    if ddp.fits is None:
        return ddp, ("no GPU memory given, so nothing rules DDP out; it is the cheapest",)
    if ddp.fits:
        return ddp, (
            f"fits on one GPU ({format_bytes(ddp.memory)} ≤ {gpu_memory}): the bottleneck is time, not memory, "
            "so data parallelism (DDP) with no extra traffic",
        )
    too_large = f"does not fit on one GPU: DDP needs {format_bytes(ddp.memory)} > {gpu_memory}"
    fitting = [option for option in table if option.fits]
    if not fitting:
        least = min(table, key=lambda option: option.memory)
        least_text = (
            f"nothing fits on {cluster.world_size} GPUs: the least memory is {least.label} with "
            f"{format_bytes(least.memory)} per GPU"
        )
        return None, (too_large, least_text, *more_hardware_hints(model, cluster, workload))
    choice = fitting[0]
    reasons = [too_large, f"cheapest that fits: {choice.label}, {format_bytes(choice.memory)} per GPU"]
    cheaper = [option for option in table[: table.index(choice)] if option.strategy in ("zero1", "fsdp")]
    if cheaper:
        reasons.append(
            "cheaper shardings do not fit: "
            + ", ".join(f"{option.label} {format_bytes(option.memory)}" for option in cheaper)
        )
    return choice, tuple(reasons)


def more_hardware_hints(model: ModelSize, cluster: Cluster, workload: Workload) -> list[str]:
    """What would fit with more or larger GPUs: ZeRO-3 over ⌈16Ψ / (memory − activations)⌉ GPUs, or bigger GPUs."""
    hints = []
    activations = (activation_memory(model.shape, workload, Layout()) if model.shape else None) or 0.0
    state = model.parameters * workload.precision.bytes_per_parameter
    room = (cluster.gpu_memory or 0.0) - activations
    if room > 0 and math.isfinite(state / room):
        gpus = max(1, math.ceil(state / room))
        hints.append(f"fsdp zero3 over {gpus} GPUs fits ({format_bytes(state / gpus + activations)} per GPU)")
    else:
        hints.append(
            f"one micro-batch's activations alone ({format_bytes(activations)}) exceed the GPU: "
            "use a smaller micro-batch, or split them with tensor or pipeline parallelism"
        )
    here = state / cluster.world_size + activations
    hints.append(f"or GPUs with at least {format_bytes(here)} (fsdp zero3 over {cluster.world_size})")
    return hints


def format_bytes(value: float) -> str:
    """Bytes in decimal units for messages and tables: '14.00 GB', '2.17 MB'."""
    for unit, size in (("TB", 10**12), ("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def format_duration(seconds: float) -> str:
    """A time left, as progress lines show it: '0m41s', '12m05s', '3h07m'."""
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
