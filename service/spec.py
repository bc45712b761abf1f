"""JobSpec: the public contract of a training job, validated once at the edge.

Shared by the control plane (validation at submit) and the job driver (which trusts it).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import typing
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, cast

import yaml
from packaging.requirements import InvalidRequirement, Requirement
from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ringmaster.service.catalogue import (
    BUILTIN_MODELS,
    CORPORA,
    CORPUS_SEQ_LEN,
    HF_PREFIX,
    STRATEGIES,
    STRATEGY_NAMES,
    USER_DATA,
    BuiltinModel,
    builtin_job_rules,
    strategy_rules,
)
from ringmaster.service.errors import UNKNOWN_REFERENCE, VALUE_CONFLICT
from ringmaster.service.hf_models import HFModelFacts, UnknownHFModel, hf_model_facts
from ringmaster.service.json_types import JsonTyped

# Each pattern is matched whole (fullmatch) and written in the subset of regex that Python and JSON Schema (ECMA-262)
# read alike, ASCII classes only: the OpenAPI schema states these very patterns.
_IDENTIFIER = "[A-Za-z_][A-Za-z0-9_]*"
_ENTRYPOINT = re.compile(rf"^{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}$")
_HF_MODEL = re.compile(rf"^{HF_PREFIX}{_IDENTIFIER}$")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,62}[a-z0-9])?$")
_CLASS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
CODE_REF = re.compile(r"^sha256:[0-9a-f]{64}$")
SHARED_POOL = "shared"  # the warm pool of jobs that bring no runtime env of their own
_ENV_VAR_NAME = re.compile(rf"^{_IDENTIFIER}$")
RESERVED_ENV_PREFIX = "RINGMASTER_"  # the control plane's own variables (the driver's report secret among them)
MAX_REQUIREMENTS = 100
MAX_REQUIREMENT_CHARS = 1000
MAX_ENV_VARS = 100
MAX_ENV_NAME_CHARS = 128
MAX_ENV_VALUE_CHARS = 32 * 1024
# Names starting RESERVED_ENV_PREFIX in any case, as a pattern both regex dialects read alike (no inline flags).
_RESERVED_ENV_PATTERN = "^" + "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in RESERVED_ENV_PREFIX)
MAX_COMMAND_ARGUMENTS = 1000
MAX_COMMAND_ARGUMENT_CHARS = 32 * 1024
PEP508_FORMAT = "pep508"  # the OpenAPI format of a pip requirement: what packaging.requirements.Requirement parses


def conflict(field: str, message: str) -> PydanticCustomError:
    """A rule between fields, which no JSON Schema states: ``field`` (dotted, from the model being validated) is the one
    the 422 names, the one to change."""
    return PydanticCustomError(VALUE_CONFLICT, "{message}", {"message": message, "field": field})


class _Strict(JsonTyped):
    model_config = ConfigDict(extra="forbid")


class WorkersSpec(_Strict):
    min: int = Field(default=1, ge=1, le=1024, description="Fewest workers the job may run with (gang admission size).")
    max: int = Field(default=1, ge=1, le=1024, description="Most workers the job may run with.")
    gpus_per_worker: int = Field(
        default=0, ge=0, le=16, description="GPUs per worker actor; 0 trains on CPU with gloo."
    )
    cpus_per_worker: float = Field(
        default=1, gt=0, le=256, description="CPUs per worker actor; also its torch thread count."
    )
    gpu_memory_gb: float | None = Field(
        default=None, ge=0.001, le=4096, description="Memory of each GPU, for the planner's fit check at submit."
    )
    standby: int = Field(
        default=0,
        ge=0,
        le=64,
        description="Warm standby workers kept on capacity left idle, outside the "
        "group: a lost worker is replaced by one at once instead of by a newly started process.",
    )

    @model_validator(mode="after")
    def _min_le_max(self) -> WorkersSpec:
        if self.min > self.max:
            raise conflict("min", f"workers.min ({self.min}) must not exceed workers.max ({self.max})")
        return self


class LRScheduleSpec(_Strict):
    """The learning rate after train.warmup_steps, as a function of the step alone (so a resume needs no state)."""

    kind: Literal["constant", "cosine", "linear"] = Field(
        default="constant",
        description="constant: lr throughout; cosine or linear: decays from lr to lr × min_lr_ratio at the last step.",
    )
    min_lr_ratio: float = Field(
        default=0.0, ge=0, le=1, description="cosine, linear: the last step's LR as a fraction of lr."
    )


class ParamGroupSpec(_Strict):
    params: list[str] = Field(
        min_length=1,
        max_length=64,
        description="Glob patterns over the model's parameter names ('*.bias', 'transformer.wte.*'); a pattern "
        "that matches no parameter fails the job naming it.",
    )
    weight_decay: float | None = Field(default=None, ge=0, le=10, description="Unset: the optimizer's weight_decay.")
    lr_scale: float = Field(default=1.0, gt=0, le=1000, description="This group's LR as a multiple of the schedule's.")


class OptimizerSpec(_Strict):
    name: Literal["adamw", "sgd"] = "adamw"
    betas: tuple[float, float] = Field(
        default=(0.9, 0.999),
        description="adamw: the moments' decay rates, each in [0, 1).",
        json_schema_extra={"prefixItems": [{"type": "number", "minimum": 0, "exclusiveMaximum": 1}] * 2},
    )
    eps: float = Field(default=1e-8, gt=0, le=1, description="adamw: added to the denominator.")
    weight_decay: float | None = Field(
        default=None, ge=0, le=10, description="Decoupled (adamw) or L2 (sgd) weight decay; unset: train.weight_decay."
    )
    no_decay: Literal["none", "auto"] = Field(
        default="none",
        description="auto: no weight decay on biases and other vectors, normalization layers or embeddings (as "
        "common GPT training code and transformers' Trainer leave them); none: every parameter decays.",
    )
    groups: list[ParamGroupSpec] = Field(
        default_factory=list,
        max_length=64,
        description="Explicit parameter groups: a parameter joins the first whose patterns match its name in the "
        "model; the rest follow weight_decay and no_decay.",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in value):
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
        return value


class TrainSpec(_Strict):
    steps: int = Field(default=100, ge=1, le=10_000_000)
    global_batch_size: int = Field(default=16, ge=1)
    micro_batch_size: int = Field(default=4, ge=1)
    lr: float = Field(default=1e-3, gt=0, le=10)
    warmup_steps: int = Field(default=0, ge=0)
    lr_scaling: Literal["none", "linear"] = Field(
        default="none", description="linear: lr is multiplied by the world size."
    )
    seed: int = Field(default=0, ge=0)
    precision: Literal["fp32", "bf16"] = "fp32"
    weight_decay: float = Field(default=0.0, ge=0)
    record_sample_ids: bool = Field(
        default=False, description="Write which sample ids each step used under the job's storage (data audit)."
    )
    lr_schedule: LRScheduleSpec = Field(default_factory=LRScheduleSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    eval_every_steps: int = Field(
        default=0,
        ge=0,
        description="Evaluate the validation set (val_loss, and val_<name> for each metric of the loss_fn's own) "
        "every this many steps (0: at the end, and at checkpoints that keep_best by val_loss or a val_<name>).",
    )
    grad_clip: float | None = Field(
        default=None,
        gt=0,
        le=1e6,
        description="Scale gradients down to this global norm (over "
        "every shard and rank) when it is larger; unset: no clipping. The norm before clipping "
        "is reported each step as grad_norm either way.",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        default="none",
        description="Per block: full recomputes each block's activations in backward; selective keeps the "
        "outputs of everything but element-wise ops and norms, which it recomputes.",
    )
    compile: bool = Field(default=False, description="torch.compile each block (and the model when it has none).")

    @property
    def effective_weight_decay(self) -> float:
        return self.optimizer.weight_decay if self.optimizer.weight_decay is not None else self.weight_decay


class ParallelSpec(_Strict):
    """How the model is split; which fields apply depends on the strategy."""

    shard: Literal["zero2", "zero3", "hybrid"] = Field(
        default="zero3",
        description="fsdp/3d: what FSDP shards; hybrid shards within a node and replicates across nodes.",
    )
    tp: int = Field(
        default=1, ge=1, le=64, description="Tensor-parallel degree (tensor, 3d); its group stays inside a node."
    )
    pp: int = Field(default=1, ge=1, le=64, description="Pipeline stages (pipeline, 3d).")
    microbatches: int = Field(
        default=8,
        ge=1,
        le=4096,
        description="Pipeline micro-batches of micro_batch_size per step and data-parallel replica.",
    )
    schedule: Literal["gpipe", "1f1b", "interleaved1f1b"] = "1f1b"
    stages_per_rank: int = Field(
        default=2, ge=1, le=16, description="interleaved1f1b: model chunks (virtual stages) per pipeline rank."
    )
    blocks: list[str] | None = Field(
        default=None,
        min_length=1,
        max_length=16,
        description="Class names of the model's "
        "repeated blocks (the units of FSDP, activation checkpointing, compile and pipeline "
        "splits); unset: a Hugging Face model's _no_split_modules, else the largest list of "
        "same-class modules at any depth.",
        json_schema_extra={"items": {"type": "string", "pattern": _CLASS_NAME.pattern}},
    )

    @field_validator("blocks")
    @classmethod
    def _class_names(cls, value: list[str] | None) -> list[str] | None:
        for name in value or ():
            if not _CLASS_NAME.fullmatch(name):
                raise ValueError(f"each entry must be a Python class name, got {name!r}")
        return value


class KeepBestSpec(_Strict):
    """Keep the checkpoint with the best value of a metric besides the newest ``keep``."""

    metric: str = Field(
        pattern=r"^[A-Za-z][A-Za-z0-9_.\-/]{0,31}$",
        description="val_loss: the validation set evaluated at each checkpoint; "
        "loss: the training loss of the step the checkpoint is taken at; val_<name>: that metric of the model's "
        "loss_fn's own (its (loss, {name: value}) return) over the validation set, evaluated at each checkpoint; any "
        "other name: that metric of the loss_fn's own at that step.",
    )
    mode: Literal["min", "max"] = Field(default="min", description="Whether the lowest or the highest value is best.")


class InMemorySpec(_Strict):
    """Every step's state kept in host memory, so a re-formed group continues from the step a failure interrupted
    (at most one step redone) without reading storage."""

    enabled: bool = Field(default=True, description="false: recover from the newest durable checkpoint only.")
    replicas: int = Field(
        default=1,
        ge=0,
        le=3,
        description="Copies of each rank's state held by ranks on other "
        "nodes (0: only the rank's own, which covers the loss of other ranks only). ddp copies "
        "none: every rank's live state is the whole of it, and each rank's own few values (RNG, "
        "metric points) go to every rank.",
    )


class CheckpointSpec(_Strict):
    every_steps: int = Field(default=0, ge=0, description="0 writes only the final checkpoint.")
    keep: int = Field(default=2, ge=1, le=1000, description="How many of the newest checkpoints are kept.")
    keep_best: KeepBestSpec | None = Field(default=None, description="Also keep the best checkpoint by a metric.")
    in_memory: InMemorySpec | None = Field(
        default=None,
        description="In-memory snapshots of every step; unset: on, "
        "with 1 replica, when the group spans more than one node.",
    )

    def in_memory_replicas(self, nodes: int) -> int | None:
        """Buddy copies of each rank's snapshot for a group on `nodes` nodes; None: no in-memory snapshots."""
        if self.in_memory is None:
            return 1 if nodes > 1 else None
        return self.in_memory.replicas if self.in_memory.enabled else None

    @model_validator(mode="after")
    def _best_needs_periodic_checkpoints(self) -> CheckpointSpec:
        if self.keep_best is not None and self.every_steps == 0:
            raise conflict(
                "keep_best",
                "checkpoint.keep_best needs periodic checkpoints to choose from: set checkpoint.every_steps > 0",
            )
        return self


class _DataSourceSpec(_Strict):
    """Token windows read from a data source: sample i is (window[:-1], window[1:]) of the i-th run of seq_len + 1
    tokens (consecutive windows share their boundary token), so a sample id names fixed tokens."""

    path: str = Field(min_length=1, max_length=4096, description="Where the data lies, as the workers see it.")
    seq_len: int | None = Field(
        default=None,
        ge=1,
        le=1_048_576,
        description="Tokens per sample; unset: the built-in model's seq_len option (a user model must set it).",
    )
    val_fraction: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="The share of windows, taken from the end, held "
        "out as the validation set (0: none, unless a separate validation source is named).",
    )
    num_workers: int = Field(
        default=0,
        ge=0,
        le=64,
        description="DataLoader worker processes per rank that read "
        "samples (0: the training process reads them); the sample order is the same either way.",
    )

    _separate_validation: ClassVar[str]  # the field naming a validation set of its own, besides val_fraction

    @property
    def has_validation(self) -> bool:
        return getattr(self, self._separate_validation) is not None or self.val_fraction > 0

    @model_validator(mode="after")
    def _one_validation_split(self) -> _DataSourceSpec:
        if getattr(self, self._separate_validation) is not None and self.val_fraction:
            raise conflict(
                "val_fraction",
                f"give data.{self._separate_validation} or data.val_fraction for the validation set, not both",
            )
        return self


class TokensData(_DataSourceSpec):
    """A flat binary file of token ids (the nanoGPT/torchtitan format), memory-mapped; a remote fsspec URI is
    fetched once per node into a local cache."""

    kind: Literal["tokens"]
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="A local path, file:// URI, or any fsspec URI "
        "(s3://, gs://, …): fetched once per node into RINGMASTER_DATA_CACHE.",
    )
    dtype: Literal["uint16", "uint32"] = Field(default="uint16", description="The width of each token id in the file.")
    val_path: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="A second token file, of the same dtype, used as the validation set.",
    )

    _separate_validation: ClassVar[str] = "val_path"


class HFDatasetData(_DataSourceSpec):
    """A Hugging Face datasets directory written by save_to_disk; one column's rows are packed, in order, into one
    stream of tokens: lists of token ids as they are, strings as UTF-8 bytes (vocab 256) joined by a newline."""

    kind: Literal["hf_dataset"]
    path: str = Field(min_length=1, max_length=4096, description="The directory datasets.load_from_disk reads.")
    column: str = Field(min_length=1, max_length=256, description="The column of token-id lists or of strings.")
    split: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="The training split when the directory holds a DatasetDict (unset: 'train').",
    )
    val_split: str | None = Field(
        default=None, min_length=1, max_length=256, description="A DatasetDict's split used as the validation set."
    )

    _separate_validation: ClassVar[str] = "val_split"


DataSourceSpec = TokensData | HFDatasetData


_DATA_SOURCE_KINDS = ("tokens", "hf_dataset")


def _data_form(value: Any) -> str | None:
    """Which form a data value has: a name ('corpus'), or a data source's kind."""
    if isinstance(value, str):
        return "corpus"
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return kind if kind in _DATA_SOURCE_KINDS else None  # anything else: the custom error below


# The catalogue's names as Literals, which pydantic validates and the schema states; mypy reads no Literal built from a
# tuple, so to it they are strings.
if TYPE_CHECKING:
    _CorpusName = str
    _StrategyName = str
else:
    _CorpusName = Literal[(USER_DATA, *CORPORA)]
    _StrategyName = Literal[STRATEGY_NAMES]

_DataField = Annotated[
    Annotated[_CorpusName, Tag("corpus")]
    | Annotated[TokensData, Tag("tokens")]
    | Annotated[HFDatasetData, Tag("hf_dataset")],
    Discriminator(
        _data_form,
        custom_error_type="data_form",
        custom_error_message=(
            f"data must be a built-in corpus ({', '.join(map(repr, CORPORA))}), 'user', or a mapping whose kind is "
            "'tokens' or 'hf_dataset'"
        ),
    ),
]


class RuntimeEnvSpec(_Strict):
    """What the job's Ray runtime env adds: pip requirements installed for the job alone, and environment variables."""

    pip: list[str] = Field(
        default_factory=list,
        max_length=MAX_REQUIREMENTS,
        description="Requirement strings "
        "(PEP 508: 'name==1.2', 'name @ file:///path/to.whl'), installed by Ray for this job's processes.",
        json_schema_extra={"items": {"type": "string", "format": PEP508_FORMAT, "maxLength": MAX_REQUIREMENT_CHARS}},
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_ENV_VARS,
        description="Environment variables "
        f"of the job's driver and workers; names starting {RESERVED_ENV_PREFIX} are ringmaster's own.",
        json_schema_extra={
            "propertyNames": {
                "pattern": _ENV_VAR_NAME.pattern,
                "maxLength": MAX_ENV_NAME_CHARS,
                "not": {"pattern": _RESERVED_ENV_PATTERN},
            },
            "additionalProperties": {"type": "string", "maxLength": MAX_ENV_VALUE_CHARS},
        },
    )

    @field_validator("pip")
    @classmethod
    def _requirements_parse(cls, value: list[str]) -> list[str]:
        for index, text in enumerate(value):
            if len(text) > MAX_REQUIREMENT_CHARS:
                raise ValueError(
                    f"pip[{index}]: a requirement is at most {MAX_REQUIREMENT_CHARS} characters, got {len(text)}"
                )
            try:
                Requirement(text)
            except InvalidRequirement as error:
                raise ValueError(
                    f"pip[{index}]: {text[:100]!r} is not a requirement (PEP 508, e.g. 'name==1.2' or "
                    f"'name @ file:///path/to.whl'): {error}"
                ) from None
        return value

    @field_validator("env_vars")
    @classmethod
    def _env_vars_bounded(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if len(name) > MAX_ENV_NAME_CHARS or not _ENV_VAR_NAME.fullmatch(name):
                raise ValueError(
                    f"env_vars: {name[:MAX_ENV_NAME_CHARS]!r} is not a variable name (letters, digits and '_', "
                    f"not starting with a digit, at most {MAX_ENV_NAME_CHARS} characters)"
                )
            if name.upper().startswith(RESERVED_ENV_PREFIX):
                raise ValueError(
                    f"env_vars: {name!r} is reserved: names starting {RESERVED_ENV_PREFIX} are ringmaster's own"
                )
            if len(text) > MAX_ENV_VALUE_CHARS:
                raise ValueError(
                    f"env_vars: the value of {name!r} is {len(text)} characters; at most {MAX_ENV_VALUE_CHARS}"
                )
        return value


# A job names a model (managed) or a command (script), never both: the rule as JSON Schema states it.
_MODEL_OR_COMMAND: list[dict[str, Any]] = [
    {"anyOf": [{"required": ["model"]}, {"required": ["command"]}]},
    {
        "not": {
            "required": ["model", "command"],
            "properties": {"model": {"type": "string"}, "command": {"type": "array"}},
        }
    },
]


class JobSpec(_Strict):
    # The rules between fields that JSON Schema can state; the others are 422s of type VALUE_CONFLICT.
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"allOf": [*builtin_job_rules(), *strategy_rules(), *_MODEL_OR_COMMAND]}
    )

    name: str = Field(
        description="Lower-case name: letters, digits, '.', '_' and '-'.", json_schema_extra={"pattern": _NAME.pattern}
    )
    model: str | None = Field(
        default=None,
        description="Built-in model name, 'package.module:function' for user code, or "
        "'hf:<transformers model class>' built from its config's fields in model_options (a class the "
        f"server's transformers lacks is a 422 of type {UNKNOWN_REFERENCE}). A managed job names a model; a script "
        "job gives command instead.",
        json_schema_extra={
            "anyOf": [
                {"type": "string", "enum": list(BUILTIN_MODELS)},
                {"type": "string", "pattern": _ENTRYPOINT.pattern},
                {"type": "string", "pattern": _HF_MODEL.pattern},
                {"type": "null"},
            ]
        },
    )
    command: list[str] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_COMMAND_ARGUMENTS,
        description="Script mode: the command each worker runs once, as its own process with the environment "
        "torchrun gives a rank (e.g. ['python', 'train.py', '--lr', '0.1']), in the job's code directory; 'python' "
        "is the job's own interpreter. Give either model or command.",
        json_schema_extra={"items": {"type": "string", "minLength": 1, "maxLength": MAX_COMMAND_ARGUMENT_CHARS}},
    )
    stop_grace_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="Script mode: seconds a stopped script's processes have between SIGTERM and SIGKILL (on cancel, "
        "and when the group restarts).",
    )
    preemptible: bool = Field(
        default=True,
        description="Whether a job of higher priority (or a tenant owed its fair share) may stop this one to start: "
        "it saves its state, goes back to the queue in its place and resumes, with at most one step redone and no "
        "failure counted. An elastic job is shrunk toward workers.min before it is stopped whole.",
    )
    data: _DataField | None = Field(
        default=None,
        description="Built-in corpus ('pysource', 'synthetic'), "
        "'user', or a data source ({kind: tokens | hf_dataset, …}); default follows the model.",
    )
    model_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options for the model builder (e.g. sizes)."
    )
    model_parameters: int | None = Field(
        default=None,
        ge=1,
        description="Parameter count of a user model, for the planner "
        "(strategy auto, the fit check against workers.gpu_memory_gb); built-ins are sized from model_options.",
    )
    strategy: _StrategyName = "ddp"
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    workers: WorkersSpec = Field(default_factory=WorkersSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    max_failures: int = Field(default=3, ge=0, le=100)
    priority: int = Field(default=0, ge=-1000, le=1000)
    resume_from: str | None = Field(
        default=None,
        description="Id of another job (or an unambiguous prefix of one, stored as the whole id): this job starts "
        "from that job's newest usable checkpoint (model, optimizer, step, data position; any world size) while it has "
        "none of its own.",
    )
    code: str | None = Field(
        default=None,
        description="The job's own code: 'sha256:<hex>' of an archive uploaded with "
        "POST /v1/code (`ringmaster submit --code DIR`); the job's processes run in it and import from it.",
        json_schema_extra={"anyOf": [{"type": "string", "pattern": CODE_REF.pattern}, {"type": "null"}]},
    )
    runtime_env: RuntimeEnvSpec | None = Field(
        default=None, description="pip requirements and environment variables of the job's own Ray runtime env."
    )

    @field_validator("code")
    @classmethod
    def _code_ref_shape(cls, value: str | None) -> str | None:
        if value is not None and not CODE_REF.fullmatch(value):
            raise ValueError(
                f"must be 'sha256:' and 64 lower-case hex digits (what POST /v1/code answers), got {value[:80]!r}"
            )
        return value

    @property
    def has_own_runtime_env(self) -> bool:
        """The job runs in processes of its own (its code, requirements or variables), never in shared warm workers."""
        return self.code is not None or self.runtime_env is not None

    @property
    def warm_pool(self) -> str:
        """The warm pool whose workers this job may claim: SHARED_POOL, or one per distinct runtime env (code,
        requirements and variables), named by their hash, so a job only ever takes processes of its own env."""
        if not self.has_own_runtime_env:
            return SHARED_POOL
        own = self.runtime_env or RuntimeEnvSpec()
        content = json.dumps({"code": self.code, "pip": own.pip, "env_vars": own.env_vars}, sort_keys=True)
        return "env-" + hashlib.sha256(content.encode()).hexdigest()[:16]

    @field_validator("name")
    @classmethod
    def _name_shape(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError(
                "must be 1-64 characters of a-z, 0-9, '.', '_' or '-', starting and ending with a letter or digit"
            )
        return value

    @field_validator("command")
    @classmethod
    def _command_arguments(cls, value: list[str] | None) -> list[str] | None:
        for index, argument in enumerate(value or ()):
            if not argument or len(argument) > MAX_COMMAND_ARGUMENT_CHARS:
                raise ValueError(
                    f"command[{index}]: each argument must be 1 to {MAX_COMMAND_ARGUMENT_CHARS} characters, "
                    f"got {len(argument)}"
                )
        return value

    @field_validator("model")
    @classmethod
    def _model_known(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if value not in BUILTIN_MODELS and not _ENTRYPOINT.fullmatch(value) and not _HF_MODEL.fullmatch(value):
            raise ValueError(
                f"must be one of {', '.join(BUILTIN_MODELS)}, 'package.module:function' or "
                f"'{HF_PREFIX}<ModelClass>', got {value!r}"
            )
        if _HF_MODEL.fullmatch(value):
            try:
                hf_model_facts(value.removeprefix(HF_PREFIX))
            except UnknownHFModel as error:
                raise PydanticCustomError(UNKNOWN_REFERENCE, "{message}", {"message": str(error)}) from None
        return value

    @property
    def is_script(self) -> bool:
        """A script job (command): its workers run the team's own script, not ringmaster's training loop."""
        return self.command is not None

    @property
    def model_name(self) -> str:
        """The model of a managed job (every job but a script job names one)."""
        if self.model is None:
            raise ValueError("a script job (command) has no model")
        return self.model

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if (self.model is None) == (self.command is None):
            given = "both" if self.model is not None else "neither"
            raise conflict(
                "command" if self.model is not None else "model",
                f"give exactly one of model (a managed job: ringmaster's training loop) and command (a script job: "
                f"your own script, run as torchrun runs it); got {given}",
            )
        if self.command is not None:
            return self
        return self._consistent_managed(self.model_name)

    def _consistent_managed(self, model: str) -> JobSpec:
        """The rules between a managed job's fields."""
        builtin = BUILTIN_MODELS.get(model)
        if builtin is not None:
            self.model_options = builtin.whole_sizes(self.model_options)
        if self.data is None:
            self.data = builtin.corpus if builtin else USER_DATA
        if isinstance(self.data, str):
            if builtin and self.data != builtin.corpus:
                raise conflict(
                    "data",
                    f"data: model {self.model_name!r} trains on {builtin.corpus!r} or a token data source, "
                    f"got {self.data!r}",
                )
        else:
            self._check_data_source(builtin)
        self._check_parallel_fields()
        if self.model_name.startswith(HF_PREFIX):
            self._check_hf_model()
        train = self.train
        for world in range(self.workers.min, self.workers.max + 1):
            model_parallel = self.parallel.tp * self.parallel.pp
            if world % model_parallel:
                raise conflict(
                    "workers.max",
                    f"workers: every world size in [{self.workers.min}, {self.workers.max}] must be a multiple of "
                    f"parallel.tp × parallel.pp ({self.parallel.tp} × {self.parallel.pp} = {model_parallel}); "
                    f"{world} is not",
                )
            per_step = self.samples_per_micro_step(world)
            if train.global_batch_size % per_step:
                raise conflict(
                    "train.global_batch_size",
                    f"train.global_batch_size ({train.global_batch_size}) must be a multiple of "
                    f"{self._micro_step_formula(world)} = {per_step}) "
                    f"for every world size in workers [{self.workers.min}, {self.workers.max}]",
                )
        if train.warmup_steps > train.steps:
            raise conflict(
                "train.warmup_steps", f"train.warmup_steps ({train.warmup_steps}) exceeds train.steps ({train.steps})"
            )
        return self

    def _check_data_source(self, builtin: BuiltinModel | None) -> None:
        """A data source's windows must fit the model, and a validation set must exist where one is asked for."""
        data = self.data
        assert not isinstance(data, str) and data is not None
        if builtin is not None:
            if builtin.seq_len_option is None:
                raise conflict(
                    "data",
                    f"data: model {self.model_name!r} trains on {builtin.corpus!r} only; data kind {data.kind!r} "
                    f"needs a model of token sequences",
                )
            model_seq_len = builtin.option(builtin.seq_len_option, self.model_options)
            if data.seq_len is None:
                # An option that is no integer stays as given here: planning the job refuses it (builtin_model_size).
                data.seq_len = cast(int, model_seq_len)
            elif isinstance(model_seq_len, int) and data.seq_len > model_seq_len:
                raise conflict(
                    "data.seq_len",
                    f"data.seq_len ({data.seq_len}) exceeds model {self.model_name!r}'s "
                    f"model_options.{builtin.seq_len_option} ({model_seq_len})",
                )
        elif data.seq_len is None:
            if self.model_name.startswith(HF_PREFIX):
                raise conflict(
                    "data.seq_len",
                    f"data.seq_len must be set: the length of the windows model {self.model_name!r} "
                    "trains on, at most its context length",
                )
            raise conflict(
                "data.seq_len",
                f"data.seq_len must be set: model {self.model_name!r} is a user model, whose context "
                "length ringmaster cannot know",
            )
        if not data.has_validation:
            separate = "data.val_path" if data.kind == "tokens" else "data.val_split"
            keep_best = self.checkpoint.keep_best
            if self.train.eval_every_steps:
                raise conflict(
                    "train.eval_every_steps",
                    f"train.eval_every_steps needs a validation set: set data.val_fraction or {separate}",
                )
            if keep_best is not None and keep_best.metric.startswith("val_"):
                raise conflict(
                    "checkpoint.keep_best.metric",
                    f"checkpoint.keep_best.metric {keep_best.metric!r} needs a validation set: "
                    f"set data.val_fraction or {separate}",
                )

    def _check_hf_model(self) -> None:
        """What transformers' source says of an hf: model: parallel.tp needs the tensor-parallel plan its config
        ships, and its windows must fit its context length."""
        model_class = self.model_name.removeprefix(HF_PREFIX)
        facts = hf_model_facts(model_class)
        if self.parallel.tp > 1 and not facts.has_tp_plan:
            raise conflict(
                "parallel.tp",
                f"parallel.tp: transformers ships no tensor-parallel plan for {model_class} "
                f"({facts.config_class or 'its config'} has no base_model_tp_plan); give the job a model "
                "function of your own that returns a ModelBundle with a tensor_parallel hook",
            )
        self._check_hf_context(facts)

    def _check_hf_context(self, facts: HFModelFacts) -> None:
        """An hf: model's windows (data.seq_len, or model_options.seq_len on the built-in corpus) must fit its context
        length: its config field (max_position_embeddings, or the config's name for it) in model_options, else that
        field's default in transformers' source."""
        field = facts.context_field
        if field is None:
            return
        given = self.model_options.get(field)
        if given is None:
            context = facts.context_default
        elif isinstance(given, (int, float)) and not isinstance(given, bool) and float(given).is_integer():
            context = int(given)
        else:
            return  # not a length: the config refuses it on the cluster, naming it
        if context is None:
            return
        data = self.data
        if isinstance(data, str):
            where, window = "model_options.seq_len", self.model_options.get("seq_len", CORPUS_SEQ_LEN)
        else:
            assert data is not None  # _consistent gave it its default before this check
            where, window = "data.seq_len", data.seq_len
        if isinstance(window, int) and window > context:
            source = f"model_options.{field}" if given is not None else f"{facts.config_class}'s default {field}"
            raise conflict(
                where,
                f"{where} ({window}) exceeds the context length of model {self.model_name!r}: {source} is {context}",
            )

    def _check_parallel_fields(self) -> None:
        parallel, strategy = self.parallel, self.strategy
        entry = STRATEGIES.get(strategy)  # None for auto, which the planner resolves
        splits = entry.splits if entry else frozenset()
        degrees = {"tp": parallel.tp, "pp": parallel.pp}
        if not splits and (parallel.tp, parallel.pp) != (1, 1):
            splitting = [name for name, other in STRATEGIES.items() if other.splits]
            raise conflict(
                "parallel.tp" if parallel.tp != 1 else "parallel.pp",
                f"parallel.tp and parallel.pp apply to strategies {', '.join(splitting[:-1])} and "
                f"{splitting[-1]}, not {strategy!r}",
            )
        if entry and entry.requires:
            needs = [f"parallel.{name} >= 2" for name in sorted(entry.requires)]
            needs += [f"parallel.{name} = 1" for name in degrees if name not in splits]
            if any(degrees[name] < 2 for name in entry.requires) or any(
                degrees[name] != 1 for name in degrees if name not in splits
            ):
                raise conflict("strategy", f"strategy {strategy!r} needs {' and '.join(needs)}")
        if parallel.shard == "hybrid" and not (entry and entry.shards):
            sharding = [name for name, other in STRATEGIES.items() if other.shards]
            raise conflict(
                "parallel.shard",
                f"parallel.shard 'hybrid' applies to strategies {' and '.join(sharding)}, not {strategy!r}",
            )
        if parallel.schedule == "interleaved1f1b" and parallel.pp > 1 and parallel.microbatches % parallel.pp:
            raise conflict(
                "parallel.microbatches",
                f"parallel.microbatches ({parallel.microbatches}) must be a multiple of parallel.pp ({parallel.pp}) "
                "for interleaved1f1b",
            )

    def data_parallel_size(self, world_size: int) -> int:
        """Replicas of the model: what is left of the world after tensor and pipeline splits."""
        return world_size // (self.parallel.tp * self.parallel.pp)

    def samples_per_micro_step(self, world_size: int) -> int:
        """Samples one gradient-accumulation micro-step consumes across the whole world."""
        microbatches = self.parallel.microbatches if self.parallel.pp > 1 else 1
        return self.train.micro_batch_size * microbatches * self.data_parallel_size(world_size)

    def _micro_step_formula(self, world_size: int) -> str:
        dp = self.data_parallel_size(world_size)
        if self.parallel.pp > 1:
            return (
                "micro_batch_size × parallel.microbatches × data-parallel size "
                f"({self.train.micro_batch_size} × {self.parallel.microbatches} × {dp}"
            )
        if self.parallel.tp > 1:
            return f"micro_batch_size × data-parallel size ({self.train.micro_batch_size} × {dp}"
        return f"micro_batch_size × world size ({self.train.micro_batch_size} × {world_size}"

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-steps per optimizer step that keep the global batch fixed at this world size."""
        return self.train.global_batch_size // self.samples_per_micro_step(world_size)

    def scaled_lr(self, world_size: int) -> float:
        """lr_scaling: linear multiplies lr by the number of data-parallel replicas (one replica = lr)."""
        return (
            self.train.lr * self.data_parallel_size(world_size) if self.train.lr_scaling == "linear" else self.train.lr
        )

    def spec_hash(self) -> str:
        fields = self.model_dump(mode="json")
        # Specs without these optional fields hash as they did before the fields existed.
        for name in ("resume_from", "code", "runtime_env", "command"):
            if fields[name] is None:
                del fields[name]
        if fields["stop_grace_s"] == JobSpec.model_fields["stop_grace_s"].default:
            del fields["stop_grace_s"]
        if fields["checkpoint"]["keep_best"] is None:
            del fields["checkpoint"]["keep_best"]
        del fields["checkpoint"]["in_memory"]  # where state is kept between steps changes nothing trained
        del fields["preemptible"]  # whether it may be stopped and resumed changes nothing trained
        for name, default in TrainSpec().model_dump(mode="json", include=set(_LATER_TRAIN_FIELDS)).items():
            if fields["train"][name] == default:
                del fields["train"][name]
        if fields["parallel"]["blocks"] is None:
            del fields["parallel"]["blocks"]
        canonical = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


_LATER_TRAIN_FIELDS = (
    "lr_schedule",
    "optimizer",
    "eval_every_steps",
    "grad_clip",
    "activation_checkpointing",
    "compile",
)  # left out of spec_hash at their defaults


def parse_spec_text(text: str) -> JobSpec:
    """Parse a YAML or JSON job spec (JSON is YAML)."""
    document = yaml.safe_load(text)
    if not isinstance(document, dict):
        raise ValueError("a job spec must be a mapping of fields")
    return JobSpec.model_validate(document)


def field_meant(model: type[JsonTyped], loc: tuple[str | int, ...]) -> str | None:
    """For a field name the spec does not know at `loc` (a pydantic extra_forbidden error's), the known field of the
    same place whose name is closest to it, if any is close: a misspelling's likely intent."""
    models: list[type[JsonTyped]] = [model]
    for part in loc[:-1]:
        fields = [current.model_fields[str(part)] for current in models if str(part) in current.model_fields]
        if fields:
            models = [nested for field in fields for nested in _models_in(field.annotation)]
        else:  # a union member's tag (data's kind)
            models = [
                current
                for current in models
                if "kind" in current.model_fields and part in typing.get_args(current.model_fields["kind"].annotation)
            ]
    names = {name for current in models for name in current.model_fields}
    close = difflib.get_close_matches(str(loc[-1]), sorted(names), n=1, cutoff=0.6) if loc else []
    return close[0] if close else None


def _models_in(annotation: Any) -> list[type[JsonTyped]]:
    """The spec models a field's type may hold (through Optional, unions and Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, JsonTyped):
        return [annotation]
    return [model for argument in typing.get_args(annotation) for model in _models_in(argument)]
