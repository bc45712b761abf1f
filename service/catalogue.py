"""The catalogue of strategies and built-in models: what the JobSpec accepts, what the planner weighs, and how the
workers compose and build them. Torch-free, so the control plane validates and plans with it; the workers read the
same entries. Adding a strategy or a built-in model is one entry here plus its module in workers/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the JSON Schema fragments' types, as pydantic's json_schema_extra takes them
    from pydantic.config import JsonDict, JsonValue

DataParallel = Literal["ddp", "fsdp", "replicate"]
MAX_INT64 = 2**63 - 1  # the largest integer a request may carry (what a BIGINT and SQLite's INTEGER hold)


@dataclass(frozen=True)
class StrategyEntry:
    """One JobSpec strategy: which model-parallel splits it uses, and how its data-parallel replicas synchronise."""

    name: str
    summary: str
    # The parallel dimensions the strategy may split (> 1), and those it must.
    splits: frozenset[str] = frozenset()
    requires: frozenset[str] = frozenset()
    # How replicas synchronise gradients: DDP, FSDP2 (fully_shard: sharded per parallel.shard), or FSDP2's replicate
    # (which, unlike DDP, holds tensor-parallel DTensors).
    data_parallel: DataParallel = "ddp"
    # Whether the wrapper is applied with a single replica too (its state layout then stays the strategy's own).
    wraps_one_replica: bool = True
    # ZeRO-1: the optimizer's state is sharded over the data-parallel group (ZeroRedundancyOptimizer).
    shards_optimizer: bool = False

    @property
    def shards(self) -> bool:
        """Whether parallel.shard (zero2, zero3, hybrid) applies: FSDP is the data-parallel wrapper."""
        return self.data_parallel == "fsdp"

    def zero_stage(self, shard: str | None) -> int:
        """The ZeRO stage the data-parallel axis runs at."""
        if self.shards_optimizer:
            return 1
        return {"zero2": 2, "zero3": 3, "hybrid": 3}[shard] if self.shards and shard else 0


STRATEGIES: dict[str, StrategyEntry] = {
    entry.name: entry
    for entry in (
        StrategyEntry("ddp", "every rank holds the whole model; gradients are all-reduced during backward"),
        StrategyEntry(
            "zero1", "DDP gradients, the optimizer state sharded over the data-parallel group", shards_optimizer=True
        ),
        StrategyEntry(
            "fsdp",
            "FSDP2: parameters, gradients and optimizer state sharded (zero2, zero3, hybrid)",
            data_parallel="fsdp",
        ),
        StrategyEntry(
            "pipeline",
            "the blocks split into parallel.pp stages, driven by a micro-batch schedule",
            splits=frozenset({"pp"}),
            requires=frozenset({"pp"}),
            wraps_one_replica=False,
        ),
        StrategyEntry(
            "tensor",
            "attention heads and MLP split over parallel.tp ranks of a node, Megatron-style",
            splits=frozenset({"tp"}),
            requires=frozenset({"tp"}),
            data_parallel="replicate",
            wraps_one_replica=False,
        ),
        StrategyEntry(
            "3d",
            "pipeline × tensor × FSDP data parallel on one mesh",
            splits=frozenset({"tp", "pp"}),
            data_parallel="fsdp",
            wraps_one_replica=False,
        ),
    )
}
AUTO = "auto"  # not a strategy: the planner picks one at submit
STRATEGY_NAMES = (*STRATEGIES, AUTO)


@dataclass(frozen=True)
class BuiltinModel:
    """A model ringmaster ships: its builder, the corpus it trains on, and the options that size it."""

    name: str
    entrypoint: str  # package.module:function in workers/models, called with model_options
    corpus: str
    # The size options and their defaults (the builder's own; tests/service/test_planner_models.py keeps them equal).
    size_defaults: dict[str, int] = field(default_factory=dict)
    # The builder's options that do not change the model's size (data options): planning ignores them.
    data_options: tuple[str, ...] = ()
    # For a model of token sequences, the size options holding its context length and its vocabulary: it may then
    # train on a token data source (JobSpec data kind tokens or hf_dataset) whose windows and ids fit them.
    seq_len_option: str | None = None
    vocab_option: str | None = None
    # Size options whose smallest value is not 1.
    size_minimums: dict[str, int] = field(default_factory=dict)

    def option(self, name: str, model_options: dict[str, object]) -> object:
        """A size option as the builder will see it: the job's value, else the builder's default."""
        return model_options.get(name, self.size_defaults[name])

    def whole_sizes(self, model_options: dict[str, object]) -> dict[str, object]:
        """model_options with each size option given as an integral float (28.0, a JSON integer) made an int, as the
        builder needs it."""
        return {
            name: int(value)
            if name in self.size_defaults and isinstance(value, float) and value.is_integer()
            else value
            for name, value in model_options.items()
        }

    def lowest(self, option: str) -> int:
        """The smallest value a size option may take (planner.builtin_model_size enforces it)."""
        return self.size_minimums.get(option, 1)

    def options_schema(self) -> JsonDict:
        """The JSON Schema of this model's model_options: its size options as bounded integers, its data options as
        anything; no other name."""
        sizes: JsonDict = {
            name: {"type": "integer", "minimum": self.lowest(name), "maximum": MAX_INT64} for name in self.size_defaults
        }
        return {
            "type": "object",
            "properties": {**sizes, **{name: {} for name in self.data_options}},
            "additionalProperties": False,
        }


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    model.name: model
    for model in (
        BuiltinModel(
            "mlp",
            "ringmaster.workers.models.mlp:build",
            "synthetic",
            {"in_dim": 16, "hidden": 64, "out_dim": 4, "depth": 2},
            ("n_train", "n_val", "noise", "data_seed"),
            size_minimums={"depth": 0},
        ),
        BuiltinModel(
            "tiny-gpt",
            "ringmaster.workers.models.tiny_gpt:build",
            "pysource",
            {"n_layers": 2, "n_heads": 4, "dim": 64, "seq_len": 64, "vocab": 256},
            ("max_corpus_bytes",),
            seq_len_option="seq_len",
            vocab_option="vocab",
            size_minimums={"vocab": 256},
        ),  # vocab: every byte
    )
}
HF_PREFIX = "hf:"  # model: hf:<transformers model class>, built from the config fields in model_options
CORPUS_SEQ_LEN = 64  # the window of an hf: model on the built-in corpus when model_options.seq_len does not say
USER_DATA = "user"  # data: the model's entrypoint brings its own datasets


def _options_rule(model_field: str, name: str, properties: JsonDict) -> JsonDict:
    """The rule: where model_field names this built-in, these properties hold."""
    return {
        "if": {"properties": {model_field: {"const": name}}, "required": [model_field]},
        "then": {"properties": properties},
    }


def builtin_options_rules(model_field: str = "model") -> list[JsonDict]:
    """JSON Schema rules (for an object's allOf) tying model_options to the built-in named in model_field."""
    return [
        _options_rule(model_field, name, {"model_options": model.options_schema()})
        for name, model in BUILTIN_MODELS.items()
    ]


def builtin_job_rules() -> list[JsonDict]:
    """JSON Schema rules of a JobSpec on a built-in: its options, no model_parameters (it is sized from its options),
    and only its own corpus or, for a model of token sequences, a data source (an object)."""
    rules: list[JsonDict] = []
    for name, model in BUILTIN_MODELS.items():
        data: list[JsonValue] = [{"type": "null"}, {"const": model.corpus}]
        if model.seq_len_option is not None:
            data.append({"type": "object"})
        properties: JsonDict = {
            "model_options": model.options_schema(),
            "model_parameters": {"type": "null"},
            "data": {"anyOf": data},
        }
        rules.append(_options_rule("model", name, properties))
    return rules


def strategy_rules() -> list[JsonDict]:
    """JSON Schema rules of a JobSpec's parallel fields under each strategy: the degrees it must split (≥ 2), those it
    may not (= 1), and whether parallel.shard may be 'hybrid'. ddp's rule also holds when strategy is absent (its
    default)."""
    rules: list[JsonDict] = []
    for name in STRATEGY_NAMES:
        entry = STRATEGIES.get(name)  # None: auto, which splits nothing until the planner resolves it
        splits, requires = (entry.splits, entry.requires) if entry else (frozenset(), frozenset())
        properties: JsonDict = {
            degree: {"minimum": 2} if degree in requires else {"const": 1}
            for degree in ("tp", "pp")
            if degree in requires or degree not in splits
        }
        if not (entry and entry.shards):
            properties["shard"] = {"not": {"const": "hybrid"}}
        parallel: JsonDict = {"properties": properties}
        if requires:
            parallel["required"] = [*sorted(requires)]  # a list[JsonValue]: list is invariant
        condition: JsonDict = {"properties": {"strategy": {"const": name}}}
        if name != "ddp":
            condition["required"] = ["strategy"]
        then: JsonDict = {"properties": {"parallel": parallel}}
        if requires:
            then["required"] = ["parallel"]
        rules.append({"if": condition, "then": then})
    return rules


CORPORA = tuple(sorted({model.corpus for model in BUILTIN_MODELS.values()}))
