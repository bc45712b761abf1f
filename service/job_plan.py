"""The planner applied to a job: ``strategy: auto`` resolved at submit, the checks that reject a job which
cannot fit its GPUs or nodes before anything is written, and each rank's predicted state memory."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ringmaster.service import planner
from ringmaster.service.catalogue import BUILTIN_MODELS, STRATEGIES
from ringmaster.service.errors import DOES_NOT_FIT, VALUE_CONFLICT, InvalidSpec, PlanError
from ringmaster.service.settings import Settings
from ringmaster.service.spec import JobSpec, WorkersSpec


@dataclass(frozen=True)
class ClusterShape:
    """The nodes workers land on, as far as the control plane knows them; None is unknown."""

    gpus_per_node: int | None = None
    cpus_per_node: float | None = None
    nodes: int | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> ClusterShape | None:
        if settings.gpus_per_node is None and settings.cpus_per_node is None:
            return None
        return cls(settings.gpus_per_node, settings.cpus_per_node, settings.nodes)

    def workers_per_node(self, workers: WorkersSpec) -> int | None:
        """Workers one node holds: its GPUs over gpus_per_worker, or for CPU jobs its CPUs over cpus_per_worker."""
        if workers.gpus_per_worker:
            return None if self.gpus_per_node is None else self.gpus_per_node // workers.gpus_per_worker
        return None if self.cpus_per_node is None else int(self.cpus_per_node // workers.cpus_per_worker)

    def describe(self, workers: WorkersSpec) -> str:
        if workers.gpus_per_worker:
            return f"{self.gpus_per_node} GPUs per node / {workers.gpus_per_worker} gpus_per_worker"
        return f"{self.cpus_per_node:g} CPUs per node / {workers.cpus_per_worker:g} cpus_per_worker"


ClusterShapeProvider = Callable[[], ClusterShape | None]
"""Returns the shape of the cluster's nodes now, or None when unknown (then node checks are skipped)."""


@dataclass(frozen=True)
class PlannedSpec:
    """The spec to store (``auto`` resolved) and, when the planner chose, the event that says why."""

    spec: JobSpec
    message: str | None = None
    data: dict[str, Any] | None = None


def plan_submission(spec: JobSpec, shape: ClusterShape | None) -> PlannedSpec:
    """Resolve ``auto`` and reject a job whose strategy cannot fit its GPU memory or keep tp inside a node."""
    per_node = shape.workers_per_node(spec.workers) if shape else None
    if shape is not None and per_node is not None:
        _check_fits_nodes(spec, shape, per_node)
    if spec.is_script:
        return PlannedSpec(spec)  # the script splits its model itself: nothing for the planner to choose or check
    gpu_memory = spec.workers.gpu_memory_gb * planner.GB if spec.workers.gpu_memory_gb else None
    needs_size = spec.strategy == "auto" or gpu_memory is not None
    model = job_model_size(spec) if needs_size else None
    cluster = planner.Cluster(world_size=spec.workers.min, gpus_per_node=per_node, gpu_memory=gpu_memory)
    workload = job_workload(spec)
    if spec.strategy == "auto":
        return _resolve_auto(spec, model, cluster, workload)
    if model is not None and gpu_memory is not None:
        option = planner.evaluate(
            model, cluster, workload, spec.strategy, _shard(spec), job_layout(spec, spec.workers.min, per_node)
        )
        if not option.fits:
            raise _does_not_fit(
                spec, model, cluster, workload, f"strategy {_name(spec)} needs {_needs(option, cluster)}"
            )
    return PlannedSpec(spec)


def _check_fits_nodes(spec: JobSpec, shape: ClusterShape, per_node: int) -> None:
    """A worker must fit on a node, workers.min on the cluster's nodes (when their number is known), and a
    tensor-parallel group inside one node (the seeds' placement rule)."""
    workers = spec.workers
    if per_node == 0:
        field = "gpus_per_worker" if workers.gpus_per_worker else "cpus_per_worker"
        raise InvalidSpec(
            [
                _error(
                    DOES_NOT_FIT,
                    ("workers", field),
                    f"workers.{field} is more than one node has ({shape.describe(workers)}): no node can hold a worker",
                )
            ]
        )
    capacity = per_node * shape.nodes if shape.nodes is not None else None
    if capacity is not None and workers.min > capacity:
        raise InvalidSpec(
            [
                _error(
                    DOES_NOT_FIT,
                    ("workers", "min"),
                    f"workers.min ({workers.min}) is more workers than the cluster holds: {shape.nodes} node(s) × "
                    f"{per_node} ({shape.describe(workers)}) = {capacity}; the job would wait in the queue forever",
                )
            ]
        )
    tp = spec.parallel.tp
    if tp > 1 and per_node % tp:
        worlds = range(workers.min, workers.max + 1)
        fitting = [
            t
            for t in range(2, per_node + 1)
            if per_node % t == 0 and all(w % (t * spec.parallel.pp) == 0 for w in worlds)
        ]
        would_fit = (
            f"tp that would fit: {', '.join(map(str, fitting))}"
            if fitting
            else ("no tp above 1 fits these workers; use strategy pipeline or fsdp, or workers that fill whole nodes")
        )
        raise InvalidSpec(
            [
                _error(
                    DOES_NOT_FIT,
                    ("parallel", "tp"),
                    f"parallel.tp ({tp}) must divide the workers per node ({per_node} = {shape.describe(workers)}) "
                    f"so that each tensor-parallel group stays inside one node; {would_fit}",
                )
            ]
        )


def job_model_size(spec: JobSpec) -> planner.ModelSize | None:
    """A built-in is sized from its model_options; a user model by model_parameters (None when not given)."""
    if spec.model in BUILTIN_MODELS:
        if spec.model_parameters is not None:
            raise InvalidSpec(
                [
                    _error(
                        VALUE_CONFLICT,
                        ("model_parameters",),
                        f"built-in model {spec.model!r} is sized from model_options; leave model_parameters unset",
                    )
                ]
            )
        try:
            return planner.builtin_model_size(spec.model, spec.model_options)
        except PlanError as error:
            raise InvalidSpec([_error(error.kind, tuple(error.field.split(".")), str(error))]) from error
    if spec.model_parameters is None:
        return None
    return planner.ModelSize(spec.model_parameters, None, f"{spec.model} ({spec.model_parameters:,} parameters)")


def job_workload(spec: JobSpec) -> planner.Workload:
    parallel = spec.parallel
    return planner.Workload(
        planner.PRECISIONS[spec.train.precision],
        spec.train.micro_batch_size,
        parallel.microbatches,
        parallel.schedule,
        parallel.stages_per_rank,
    )


def job_layout(spec: JobSpec, world_size: int, workers_per_node: int | None) -> planner.Layout:
    """The spec's split at a world size; hybrid shards over the data-parallel ranks that share a node (dp outermost)."""
    parallel = spec.parallel
    dp = spec.data_parallel_size(world_size)
    shard_group = None
    if _shard(spec) == "hybrid" and workers_per_node is not None:
        shard_group = math.gcd(dp, max(1, workers_per_node // (parallel.tp * parallel.pp)))
    zero = planner.strategy_zero_stage(spec.strategy, _shard(spec))
    return planner.Layout(dp=dp, tp=parallel.tp, pp=parallel.pp, zero=zero, shard_group=shard_group)


def predicted_rank_state(spec: JobSpec, parameter_count: int, dp: int, tp: int, pp: int) -> planner.StateMemory | None:
    """What the planner predicts one rank holds between steps, where the driver measures it.

    FSDP's zero2 (reshard_after_forward=False) keeps parameters gathered only from forward to the end of
    backward, which the fit check counts; between steps they are sharded, as under ZeRO-3. None for hybrid
    sharding, whose shard group size a rank does not report.
    """
    shard = _shard(spec)
    if shard == "hybrid":
        return None
    zero = 3 if shard == "zero2" else planner.strategy_zero_stage(spec.strategy, shard)
    layout = planner.Layout(dp=dp, tp=tp, pp=pp, zero=zero)
    return planner.state_memory(parameter_count, planner.PRECISIONS[spec.train.precision], layout)


def _resolve_auto(
    spec: JobSpec, model: planner.ModelSize | None, cluster: planner.Cluster, workload: planner.Workload
) -> PlannedSpec:
    """The planner's pick, or the next fitting option when the pick breaks a rule of the spec (e.g. batch
    divisibility)."""
    if model is None or cluster.gpu_memory is None:
        unknown = (
            "the model's size is unknown (set model_parameters for a user model)"
            if model is None
            else "workers.gpu_memory_gb is not given"
        )
        ddp = _with_fields(spec, {"strategy": "ddp", "parallel": {"tp": 1, "pp": 1}})
        return _resolved(ddp, None, (f"{unknown}, so nothing rules DDP out; it is the cheapest",))
    plan = planner.plan(model, cluster, workload)
    reasons, skipped = list(plan.reasons), []
    for option in plan.options:
        if not option.fits:
            continue
        try:
            resolved = _with_fields(spec, option.spec_fields())
        except ValidationError as error:
            skipped.append(f"{option.label} breaks the spec: {_messages(error)}")
            continue
        if option is not plan.recommendation:
            reasons += [*skipped, f"so: {option.label}, {planner.format_bytes(option.memory)} per GPU"]
        return _resolved(resolved, option, tuple(reasons))
    detail = "; ".join([*plan.reasons, *skipped])
    raise InvalidSpec([_error(DOES_NOT_FIT, ("workers", "gpu_memory_gb"), f"strategy auto: {detail}")])


def _resolved(spec: JobSpec, option: planner.Option | None, reasons: tuple[str, ...]) -> PlannedSpec:
    label = option.label if option else spec.strategy
    data: dict[str, Any] = {
        "requested": "auto",
        "strategy": spec.strategy,
        "parallel": spec.parallel.model_dump(mode="json"),
        "world_size": spec.workers.min,
        "reasons": list(reasons),
    }
    if option is not None:
        data["predicted_per_gpu_bytes"] = {
            "parameters": option.state.parameters,
            "gradients": option.state.gradients,
            "optimizer": option.state.optimizer,
            "activations": option.activations,
            "total": option.memory,
        }
    return PlannedSpec(spec, f"strategy auto resolved to {label}: {'; '.join(reasons)}", data)


def _with_fields(spec: JobSpec, fields: dict[str, Any]) -> JobSpec:
    """The spec with another strategy and split, validated again (hybrid is only valid for fsdp and 3d)."""
    document = spec.model_dump(mode="json")
    parallel = {**document["parallel"], **fields["parallel"]}
    if "shard" not in fields["parallel"] and parallel["shard"] == "hybrid":
        parallel["shard"] = "zero3"
    return JobSpec.model_validate({**document, "strategy": fields["strategy"], "parallel": parallel})


def _does_not_fit(
    spec: JobSpec, model: planner.ModelSize, cluster: planner.Cluster, workload: planner.Workload, needs: str
) -> InvalidSpec:
    """The 422 for a strategy that cannot fit: what it needs, and what would fit instead."""
    alternatives: list[str] = []
    for option in planner.options(model, cluster, workload):
        if option.fits and len(alternatives) < 3:
            try:
                _with_fields(spec, option.spec_fields())
            except ValidationError:
                continue
            alternatives.append(f"{_option_fields(option)} ({planner.format_bytes(option.memory)} per GPU)")
    if alternatives:
        would_fit = f"would fit at {cluster.world_size} workers: {'; '.join(alternatives)}"
    else:
        would_fit = f"nothing fits at {cluster.world_size} workers; " + "; ".join(
            planner.more_hardware_hints(model, cluster, workload)
        )
    return InvalidSpec([_error(DOES_NOT_FIT, ("workers", "gpu_memory_gb"), f"{needs}; {would_fit}")])


def _needs(option: planner.Option, cluster: planner.Cluster) -> str:
    parts = (
        f"parameters {planner.format_bytes(option.state.parameters)}"
        f" + gradients {planner.format_bytes(option.state.gradients)}"
        f" + optimizer {planner.format_bytes(option.state.optimizer)}"
    )
    if option.activations is not None:
        parts += f" + activations {planner.format_bytes(option.activations)}"
    return (
        f"{planner.format_bytes(option.memory)} per GPU at {cluster.world_size} workers ({parts}), more than "
        f"workers.gpu_memory_gb ({planner.format_bytes(cluster.gpu_memory or 0)})"
    )


def _option_fields(option: planner.Option) -> str:
    fields = option.spec_fields()
    parallel = ", ".join(f"{key}: {value}" for key, value in fields["parallel"].items() if key == "shard" or value > 1)
    return f"strategy: {fields['strategy']}" + (f", parallel: {{{parallel}}}" if parallel else "")


def _shard(spec: JobSpec) -> str | None:
    return spec.parallel.shard if spec.strategy in STRATEGIES and STRATEGIES[spec.strategy].shards else None


def _name(spec: JobSpec) -> str:
    shard = _shard(spec)
    return f"{spec.strategy} ({shard})" if shard else spec.strategy


def _messages(error: ValidationError) -> str:
    return "; ".join(str(item["msg"]).removeprefix("Value error, ") for item in error.errors())


def _error(kind: str, loc: tuple[str, ...], message: str) -> dict[str, Any]:
    return {"type": kind, "loc": loc, "msg": message}
