"""Response bodies of the REST API, kept apart from the tables. One whose fields are its row's attributes under the
same names validates from the row itself (from_attributes: ``MetricOut.model_validate(row)``); the others convert
explicitly, field by field."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.config import JsonDict

from ringmaster.api.limits import check_document
from ringmaster.service import code_store, jobs, planner, queue_view, tenants
from ringmaster.service.catalogue import BUILTIN_MODELS, builtin_options_rules
from ringmaster.service.errors import InvalidSpec
from ringmaster.service.json_types import JsonTyped
from ringmaster.service.models import CodeArchive, Job, Metric, Tenant
from ringmaster.service.settings import Settings
from ringmaster.service.spec import conflict
from ringmaster.service.states import JobState

Row = TypeVar("Row")
Item = TypeVar("Item", bound=BaseModel)


class JobOut(BaseModel):
    id: str
    name: str
    tenant: str = Field(description="The tenant whose token submitted the job; only it (and admins) can see the job.")
    state: JobState
    waiting_reason: str | None = Field(
        description="Why a QUEUED job was not admitted at the dispatcher's last pass "
        "(over its tenant's quota, no room on the cluster); null otherwise."
    )
    queue_position: int | None = Field(
        default=None,
        description="A QUEUED job's place in the dispatcher's last plan (1 starts next); null otherwise, or before "
        "its first plan.",
    )
    attempt: int = Field(description="Current attempt number; 0 before the first dispatch.")
    failures: int
    preemptions: int = Field(
        default=0, description="How many times a job of higher priority preempted it (not counted as failures)."
    )
    preempted_for: str | None = Field(default=None, description="The job its latest preemption made room for.")
    priority: int
    created_at: datetime
    admitted_at: datetime | None = Field(description="When the current attempt was admitted.")
    started_at: datetime | None = Field(
        description="When the job first started training; a recovery or a later attempt leaves it as it is."
    )
    finished_at: datetime | None
    error: str | None
    ray_job_id: str | None = Field(description="Ray Jobs API submission id of the current attempt.")
    dashboard_url: str | None = Field(description="The current attempt in the Ray dashboard, when both are known.")
    spec: dict[str, Any] = Field(description="The submitted JobSpec, with defaults filled in.")

    @classmethod
    def from_row(cls, job: Job, settings: Settings) -> JobOut:
        return cls(**cls._fields(job, settings))

    @staticmethod
    def _fields(job: Job, settings: Settings) -> dict[str, Any]:
        """The row's values under the model's field names (shared with JobDetailOut, which adds memory). Explicit, not
        from_attributes: ray_job_id is submission_id renamed, and waiting_reason and dashboard_url are computed."""
        dashboard_url = None
        if settings.ray_dashboard_url and job.submission_id:
            dashboard_url = f"{settings.ray_dashboard_url.rstrip('/')}/#/jobs/{job.submission_id}"
        return {
            "id": job.id,
            "name": job.name,
            "tenant": job.tenant,
            "state": JobState(job.state),
            "waiting_reason": job.waiting_reason if job.state == JobState.QUEUED else None,
            "queue_position": job.queue_position if job.state == JobState.QUEUED else None,
            "attempt": job.attempt,
            "failures": job.failures,
            "preemptions": job.preemptions or 0,
            "preempted_for": job.preempted_for,
            "priority": job.priority,
            "created_at": job.created_at,
            "admitted_at": job.admitted_at,
            "started_at": job.started_at,
            "finished_at": job.finished_at,
            "error": job.error,
            "ray_job_id": job.submission_id,
            "dashboard_url": dashboard_url,
            "spec": job.spec,
        }


class StateBytesOut(BaseModel):
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    total_bytes: int


class RankMemoryOut(BaseModel):
    """One rank's training-state bytes as measured by the driver and as predicted by the planner."""

    attempt: int
    rank: int
    parameter_count: int = Field(description="Parameters of the whole (unsharded) model, as the rank counted them.")
    dp: int
    tp: int
    pp: int
    measured: StateBytesOut
    predicted: StateBytesOut | None = Field(description="The planner's bytes for this rank; null for hybrid sharding.")
    ratio: float | None = Field(description="Measured total over predicted total.")
    recorded_at: datetime

    @classmethod
    def from_comparison(cls, comparison: jobs.RankMemoryComparison) -> RankMemoryOut:
        # Explicit: measured and predicted regroup the row's bytes and the planner's (rounded) under other names.
        row, predicted = comparison.measurement, comparison.predicted
        measured = StateBytesOut(
            parameters_bytes=row.parameters_bytes,
            gradients_bytes=row.gradients_bytes,
            optimizer_bytes=row.optimizer_bytes,
            total_bytes=comparison.measured_total,
        )
        return cls(
            attempt=row.attempt,
            rank=row.rank,
            parameter_count=row.parameter_count,
            dp=row.dp,
            tp=row.tp,
            pp=row.pp,
            measured=measured,
            predicted=None
            if predicted is None
            else StateBytesOut(
                parameters_bytes=round(predicted.parameters),
                gradients_bytes=round(predicted.gradients),
                optimizer_bytes=round(predicted.optimizer),
                total_bytes=round(predicted.total),
            ),
            ratio=comparison.ratio,
            recorded_at=row.recorded_at,
        )


class ProgressOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # from a jobs.Progress

    step: int = Field(description="The newest completed training step (0 before the first).")
    total_steps: int | None = Field(description="train.steps of the spec; null for a script job (command).")
    loss: float | None = Field(description="The newest step's training loss.")
    world_size: int | None = Field(description="Workers training at the newest step.")
    samples_per_s: float | None
    recoveries: int = Field(description="Times the job went RECOVERING (a worker was lost and the group re-formed).")
    eta_s: float | None = Field(
        description="Seconds left at the pace of the newest 20 steps; null unless the job is active."
    )
    val_loss: float | None = Field(
        description="The newest validation loss (train.eval_every_steps, and at the end); null before the first."
    )
    val_step: int | None = Field(description="The step val_loss was measured after.")


class JobDetailOut(JobOut):
    memory: list[RankMemoryOut] = Field(
        description="Per attempt and rank: training-state bytes measured beside predicted."
    )
    progress: ProgressOut

    @classmethod
    def from_job(
        cls, job: Job, settings: Settings, memory: list[jobs.RankMemoryComparison], progress: jobs.Progress
    ) -> JobDetailOut:
        return cls(
            **cls._fields(job, settings),
            memory=[RankMemoryOut.from_comparison(m) for m in memory],
            progress=ProgressOut.model_validate(progress),
        )


class EventOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # from a JobEvent row

    id: int
    job_id: str
    at: datetime
    kind: str = Field(description="transition, checkpoint, plan (how strategy auto was resolved) or info.")
    from_state: JobState | None
    to_state: JobState | None
    message: str | None
    data: dict[str, Any] | None


class MetricOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # from a Metric row

    attempt: int
    step: int
    loss: float | None
    val_loss: float | None
    samples_per_s: float | None
    step_time_s: float | None
    wall_time: float | None = Field(description="Unix time at which the step finished on rank 0.")
    lr: float | None
    grad_norm: float | None = Field(description="The global gradient norm of the step, before clipping.")
    world_size: int | None
    user_metrics: dict[str, float] | None = Field(
        description="The step's values of the metrics the model's loss_fn returns beside its loss, by name (each the "
        "mean over the step's micro-batches and data-parallel ranks) and, where the step was validated, each one's "
        "mean over the validation set as val_<name>; null where it returns the loss alone."
    )
    recorded_at: datetime


class CheckpointOut(BaseModel):
    """A checkpoint on storage now (retention's deletions remove theirs)."""

    model_config = ConfigDict(from_attributes=True)  # from a Checkpoint row

    attempt: int
    step: int
    uri: str
    world_size: int
    final: bool
    created_at: datetime
    metric: str | None = Field(description="checkpoint.keep_best's metric; null when the job keeps no best.")
    metric_value: float | None = Field(description="This checkpoint's value of that metric.")
    best: bool = Field(description="Retention keeps this one as the best by the metric.")


class CodeArchiveOut(BaseModel):
    """A stored code archive of the caller's tenant; a JobSpec names it by ``code``."""

    code: str = Field(description="'sha256:<hex>' of the archive: the value of a JobSpec's code field.")
    size_bytes: int
    unpacked_bytes: int
    files: int
    created_at: datetime

    @classmethod
    def from_row(cls, row: CodeArchive) -> CodeArchiveOut:
        # Explicit: code is computed from the row's sha256.
        return cls(
            code=code_store.ref_of(row.sha256),
            size_bytes=row.size_bytes,
            unpacked_bytes=row.unpacked_bytes,
            files=row.files,
            created_at=row.created_at,
        )


class Page(BaseModel, Generic[Item]):
    items: list[Item]
    total: int = Field(description="Rows matching the query, across all pages.")
    limit: int
    offset: int

    @classmethod
    def convert(cls, page: jobs.Page[Row], item: Callable[[Row], Item]) -> Page[Item]:
        return cls(items=[item(row) for row in page.items], total=page.total, limit=page.limit, offset=page.offset)


class MetricsPage(Page[MetricOut]):
    memory: list[RankMemoryOut] = Field(
        description="Per attempt and rank: training-state bytes measured beside predicted."
    )

    @classmethod
    def build(cls, page: jobs.Page[Metric], memory: list[jobs.RankMemoryComparison]) -> MetricsPage:
        return cls(
            items=[MetricOut.model_validate(row) for row in page.items],
            total=page.total,
            limit=page.limit,
            offset=page.offset,
            memory=[RankMemoryOut.from_comparison(m) for m in memory],
        )


class ReportAck(BaseModel):
    state: JobState = Field(description="The job's state after the report; CANCELLED tells the driver to stop.")
    accepted: bool = Field(
        description="False when the report came from a superseded attempt or a finished job and was ignored."
    )
    preempting: bool = Field(
        default=False,
        description="True while the attempt is asked to stop: the driver saves its state at the next step, reports "
        "PREEMPTED and ends; the job goes back to the queue and resumes.",
    )
    preempted_for: str | None = Field(
        default=None, description="The job it is preempted for; null when its node is draining."
    )


class Health(BaseModel):
    status: str
    database: str


_SHAPE = ("layers", "hidden", "heads", "seq_len")
_NULL: JsonDict = {"type": "null"}


class PlanRequest(JsonTyped):
    """A model (a parameter count, or a built-in and its options) and a cluster to plan it on."""

    # Either a parameter count (with the transformer's whole shape, or none of it) or a built-in: the schema states it.
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "oneOf": [
                {
                    "required": ["parameters"],
                    "properties": {"parameters": {"type": "integer"}, "model": _NULL},
                    "anyOf": [
                        {"required": list(_SHAPE), "properties": {name: {"type": "integer"} for name in _SHAPE}},
                        {"properties": {name: _NULL for name in _SHAPE}},
                    ],
                },
                {
                    "required": ["model"],
                    "properties": {
                        "model": {"type": "string"},
                        "parameters": _NULL,
                        **{name: _NULL for name in _SHAPE},
                    },
                },
            ],
            "allOf": [*builtin_options_rules()],  # a list[JsonValue]: list is invariant
        },
    )

    parameters: int | None = Field(
        default=None, ge=1, le=10**15, description="Parameter count of the model; or name a built-in in model."
    )
    model: str | None = Field(
        default=None,
        max_length=64,
        description="Built-in model (tiny-gpt, mlp), sized from model_options.",
        json_schema_extra={"anyOf": [{"enum": list(BUILTIN_MODELS)}, {"type": "null"}]},
    )
    model_options: dict[str, Any] = Field(default_factory=dict, description="The built-in's options, as in a JobSpec.")
    layers: int | None = Field(
        default=None, ge=1, le=100_000, description="Transformer blocks, for activations and TP/PP traffic."
    )
    hidden: int | None = Field(default=None, ge=1, le=10**7, description="Hidden size h.")
    heads: int | None = Field(default=None, ge=1, le=100_000, description="Attention heads a.")
    seq_len: int | None = Field(default=None, ge=1, le=10**8, description="Sequence length s.")
    gpu_memory_gb: float = Field(ge=0.001, le=4096, description="Memory of each GPU, GB (10⁹ bytes).")
    gpus_per_node: int = Field(default=8, ge=1, le=64)
    nodes: int = Field(default=1, ge=1, le=4096)
    precision: Literal["fp32", "bf16", "mixed"] = Field(
        default="mixed",
        description="mixed: the seeds' 2+2+4+8 (bf16 parameters, fp32 master); bf16: ringmaster's autocast "
        "over fp32 state (4+4+8); fp32: 4+4+8.",
    )
    micro_batch_size: int | None = Field(
        default=None,
        ge=1,
        le=10**7,
        description="Sequences per micro-batch; with the shape it gives activations and tensor/pipeline traffic.",
    )
    microbatches: int = Field(default=8, ge=1, le=4096, description="Pipeline micro-batches per step.")
    schedule: Literal["gpipe", "1f1b", "interleaved1f1b"] = "1f1b"
    stages_per_rank: int = Field(default=2, ge=1, le=16, description="interleaved1f1b: model chunks per pipeline rank.")

    @field_validator("model_options")
    @classmethod
    def _bounded_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            check_document(value)
        except InvalidSpec as exc:
            raise ValueError(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _one_model(self) -> PlanRequest:
        if (self.parameters is None) == (self.model is None):
            raise conflict(
                "parameters" if self.parameters is not None else "model",
                "give either parameters (a count) or model (a built-in name), not both or neither",
            )
        shape = {"layers": self.layers, "hidden": self.hidden, "heads": self.heads, "seq_len": self.seq_len}
        given = [name for name, value in shape.items() if value is not None]
        if self.model is not None and given:
            raise conflict(
                given[0], "a built-in's layers, hidden, heads and seq_len come from its model_options; do not give them"
            )
        if given and len(given) < len(shape):
            missing = next(name for name in shape if name not in given)
            raise conflict(missing, "give layers, hidden, heads and seq_len together, or none of them")
        if self.hidden is not None and self.heads is not None and self.hidden % self.heads:
            raise conflict("hidden", f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        return self

    def model_size(self) -> planner.ModelSize:
        """The planner's model; a built-in's bad options raise PlanError."""
        if self.model is not None:
            return planner.builtin_model_size(self.model, self.model_options)
        assert self.parameters is not None
        shape = None
        if self.layers and self.hidden and self.heads and self.seq_len:
            shape = planner.TransformerShape(self.layers, self.hidden, self.heads, self.seq_len)
        described = (
            f"transformer (layers={self.layers}, hidden={self.hidden}, heads={self.heads}, seq_len={self.seq_len})"
        )
        return planner.ModelSize(self.parameters, shape, described if shape else "model")

    def cluster(self) -> planner.Cluster:
        return planner.Cluster(self.gpus_per_node * self.nodes, self.gpus_per_node, self.gpu_memory_gb * planner.GB)

    def workload(self) -> planner.Workload:
        return planner.Workload(
            planner.PRECISIONS[self.precision],
            self.micro_batch_size,
            self.microbatches,
            self.schedule,
            self.stages_per_rank,
        )


def _gb(value: float | None) -> float | None:
    return None if value is None else value / planner.GB


class MemoryGBOut(BaseModel):
    parameters_gb: float
    gradients_gb: float
    optimizer_gb: float
    activations_gb: float | None = Field(
        description="Null when the transformer's shape or the micro-batch size is not known."
    )
    total_gb: float = Field(description="State plus activations where known.")


class CommunicationGBOut(BaseModel):
    data_parallel_gb: float
    tensor_parallel_gb: float | None
    pipeline_gb: float | None
    total_gb: float | None = Field(description="Null when a part needs the transformer's shape or micro-batch size.")


class PlanOptionOut(BaseModel):
    label: str
    strategy: str
    shard: str | None
    dp: int
    tp: int
    pp: int
    spec: dict[str, Any] = Field(description="The JobSpec strategy and parallel fields that run this option.")
    memory_per_gpu: MemoryGBOut
    communication_per_step: CommunicationGBOut = Field(
        description="GB each GPU sends per step (no gradient accumulation)."
    )
    bubble: float | None = Field(description="Pipeline idle fraction (p−1)/(p+m−1); null without a pipeline.")
    bubble_fraction: str | None = Field(description="The same as an exact fraction, e.g. 3/11.")
    fits: bool | None
    reasons: list[str]

    @classmethod
    def from_option(cls, option: planner.Option) -> PlanOptionOut:
        state, traffic, bubble = option.state, option.communication, option.bubble
        return cls(
            label=option.label,
            strategy=option.strategy,
            shard=option.shard,
            dp=option.layout.dp,
            tp=option.layout.tp,
            pp=option.layout.pp,
            spec=option.spec_fields(),
            memory_per_gpu=MemoryGBOut(
                parameters_gb=state.parameters / planner.GB,
                gradients_gb=state.gradients / planner.GB,
                optimizer_gb=state.optimizer / planner.GB,
                activations_gb=_gb(option.activations),
                total_gb=option.memory / planner.GB,
            ),
            communication_per_step=CommunicationGBOut(
                data_parallel_gb=traffic.data_parallel / planner.GB,
                tensor_parallel_gb=_gb(traffic.tensor_parallel),
                pipeline_gb=_gb(traffic.pipeline),
                total_gb=_gb(traffic.total),
            ),
            bubble=None if bubble is None else float(bubble),
            bubble_fraction=None if bubble is None else f"{bubble.numerator}/{bubble.denominator}",
            fits=option.fits,
            reasons=list(option.reasons),
        )


class PlanOut(BaseModel):
    model: str
    parameters: int
    precision: str
    bytes_per_parameter: int
    precision_note: str
    world_size: int
    gpus_per_node: int
    nodes: int
    gpu_memory_gb: float
    options: list[PlanOptionOut] = Field(description="Every option, cheapest first.")
    recommendation: PlanOptionOut | None = Field(description="The pick; null when nothing fits.")
    reasons: list[str] = Field(description="Why the pick, or what would fit when nothing does.")

    @classmethod
    def from_plan(cls, plan: planner.Plan, request: PlanRequest) -> PlanOut:
        precision = plan.workload.precision
        return cls(
            model=plan.model.description,
            parameters=plan.model.parameters,
            precision=precision.name,
            bytes_per_parameter=precision.bytes_per_parameter,
            precision_note=precision.description,
            world_size=plan.cluster.world_size,
            gpus_per_node=request.gpus_per_node,
            nodes=request.nodes,
            gpu_memory_gb=request.gpu_memory_gb,
            options=[PlanOptionOut.from_option(option) for option in plan.options],
            recommendation=None if plan.recommendation is None else PlanOptionOut.from_option(plan.recommendation),
            reasons=list(plan.reasons),
        )


class QuotaIn(JsonTyped):
    """A tenant's quotas; a null (or absent) one is unlimited. Its fair-share weight, when given."""

    model_config = ConfigDict(extra="forbid")

    gpus: int | None = Field(default=None, ge=0, le=1_000_000, description="GPUs its admitted jobs may hold at once.")
    cpus: float | None = Field(
        default=None, ge=0, le=1_000_000, allow_inf_nan=False, description="CPUs its admitted jobs may hold at once."
    )
    jobs: int | None = Field(
        default=None, ge=0, le=1_000_000, description="Jobs it may have admitted or running at once."
    )
    weight: float | None = Field(
        default=None,
        gt=0,
        le=tenants.MAX_WEIGHT,
        allow_inf_nan=False,
        description="Its weight in fair share: among jobs of equal priority, capacity goes to the tenant furthest "
        "below its weighted share of the cluster. Null (or absent) keeps the current weight (1 for a new tenant).",
    )

    def quota(self) -> tenants.Quota:
        return tenants.Quota(self.gpus, self.cpus, self.jobs)


class DrainIn(JsonTyped):
    """A drain's deadline and reason."""

    model_config = ConfigDict(extra="forbid")

    deadline_s: float | None = Field(
        default=None,
        gt=0,
        le=7 * 24 * 3600,
        allow_inf_nan=False,
        description="Seconds from now until the node goes (Ray is told; it does not end the node itself). Null (or "
        "absent): no deadline.",
    )
    reason: str = Field(
        default="drained through ringmaster's API", min_length=1, max_length=256, description="Why, as Ray records it."
    )


class DrainOut(BaseModel):
    node_id: str
    deadline: datetime | None = Field(description="When the node goes; null: no deadline given.")
    reason: str


class QuotaOut(BaseModel):
    gpus: int | None
    cpus: float | None
    jobs: int | None


class UsageOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # from a tenants.Usage

    gpus: int
    cpus: float
    jobs: int


class TenantOut(BaseModel):
    name: str
    quota: QuotaOut = Field(description="Null is unlimited.")
    usage: UsageOut = Field(
        description="What its ADMITTED, RUNNING and RECOVERING jobs hold, each at its granted size."
    )
    weight: float = Field(description="Its weight in fair share (1 unless set).")
    created_at: datetime

    @classmethod
    def from_row(cls, tenant: Tenant, usage: tenants.Usage) -> TenantOut:
        # Explicit: quota gathers the row's quota_* columns, and usage comes from elsewhere.
        return cls(
            name=tenant.name,
            quota=QuotaOut(gpus=tenant.quota_gpus, cpus=tenant.quota_cpus, jobs=tenant.quota_jobs),
            usage=UsageOut.model_validate(usage),
            weight=tenant.weight,
            created_at=tenant.created_at,
        )


class PrincipalOut(BaseModel):
    tenant: TenantOut
    admin: bool
    token_id: int | None


class TokenIn(JsonTyped):
    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(pattern=tenants.NAME_PATTERN, max_length=64, description="Created without quotas when missing.")
    admin: bool = Field(
        default=False, description="An admin token sees and manages every tenant's jobs, tenants and tokens."
    )
    description: str | None = Field(default=None, max_length=255, description="Who or what holds it.")


class TokenOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # from an ApiToken row

    id: int
    tenant: str
    admin: bool
    description: str | None
    created_at: datetime
    revoked_at: datetime | None


class TokenCreatedOut(TokenOut):
    token: str = Field(description="The secret, shown this once: only its hash is stored.")
    tenant_created: bool


class QueuedWorkersOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # from a queue_view.WorkerRange

    min: int
    max: int
    cpus_per_worker: float
    gpus_per_worker: int


class QueuedJobOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # from a queue_view.QueuedJobView

    position: int | None = Field(
        description="Its place in the dispatcher's last plan over the whole queue (1 starts next), whoever asks; null "
        "for a job queued since that pass."
    )
    id: str
    name: str
    tenant: str
    priority: int
    workers: QueuedWorkersOut = Field(description="The sizes its spec accepts and what each worker holds.")
    queued_since: datetime = Field(description="When it was submitted.")
    waiting_reason: str | None = Field(
        description="Why the last plan left it waiting: its tenant's quota, the cluster's capacity, the jobs it would "
        "shrink or preempt."
    )
    preemptions: int = Field(description="How often it was stopped for a job of higher priority or a fairer share.")
    preempted_for: str | None = Field(description="The job it was last preempted for; it never preempts that one back.")


class TenantStandingOut(BaseModel):
    name: str
    weight: float = Field(description="Its weight in fair share.")
    quota: QuotaOut = Field(description="Null is unlimited.")
    held_gpus: int = Field(description="GPUs its jobs held at the dispatcher's latest sample.")
    held_cpus: float = Field(description="CPUs its jobs held at the dispatcher's latest sample.")
    share: float = Field(description="Its dominant share of the cluster then (0 to 1).")
    decayed_share: float = Field(description="Its share over the recent past, which fair share orders by.")
    entitled_share: float = Field(description="Its weight over the weights of the tenants with work.")
    sampled_at: datetime | None = Field(description="When the dispatcher took that sample; null before its first.")

    @classmethod
    def from_standing(cls, standing: queue_view.TenantStanding) -> TenantStandingOut:
        # Explicit: quota gathers a tenants.Quota's fields.
        return cls(
            name=standing.name,
            weight=standing.weight,
            quota=QuotaOut(gpus=standing.quota.gpus, cpus=standing.quota.cpus, jobs=standing.quota.jobs),
            held_gpus=standing.held_gpus,
            held_cpus=standing.held_cpus,
            share=standing.share,
            decayed_share=standing.decayed_share,
            entitled_share=standing.entitled_share,
            sampled_at=standing.sampled_at,
        )


class QueueOut(Page[QueuedJobOut]):
    tenants: list[TenantStandingOut] = Field(
        description="Each tenant's fair-share standing (a tenant's token: its own alone)."
    )


class SharePointOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # from a queue_view.SharePoint

    at: datetime
    share: float
    decayed_share: float
    entitled_share: float
    held_gpus: int
    held_cpus: float


class TenantSharesOut(BaseModel):
    tenant: str
    points: list[SharePointOut] = Field(description="Oldest first, thinned evenly to at most a few hundred.")


class ShareSeriesOut(BaseModel):
    since: datetime
    series: list[TenantSharesOut]
