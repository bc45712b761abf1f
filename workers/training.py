"""The training loop one rank runs inside an already-initialised torch.distributed process group.

It knows nothing of Ray or the control plane: progress leaves through ``TrainContext`` callbacks
(rank 0 only, except each rank's own memory report), and a retried attempt continues from the latest
committed checkpoint. The strategy (workers/strategies) decides how the model is split; the loop
only runs micro-steps on what it was handed.
"""

from __future__ import annotations

import itertools
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ringmaster.service.reports import CheckpointRecord, MetricPoint, RankMemory
from ringmaster.service.spec import JobSpec
from ringmaster.workers.checkpoint import (CommittedCheckpoint, CommittedSave, PendingSave, begin_save, checkpoint_dir,
                                checkpoint_metrics, checkpoint_stager, commit_save, find_resume_point, load_checkpoint)
from ringmaster.workers.checkpoint_storage import LocalStorage, storage_for
from ringmaster.workers.data.audit import SampleAudit
from ringmaster.workers.data.stream import DataPosition, GlobalBatchStream
from ringmaster.workers.models import build_bundle
from ringmaster.workers.models.registry import LossFn
from ringmaster.workers.parallel_dims import ParallelDims
from ringmaster.workers.state_memory import measure_rank_memory
from ringmaster.workers.strategies import OptimizerConfig, ParallelModel, ParallelSetup, parallelize

VALIDATION_BATCH_SIZE = 64  # no backward pass, so larger than a training micro-batch is cheap


def _ignore(_: Any) -> None:
    """Default callback for a context that has nobody to report to."""


def _never() -> bool:
    return False


def _ignore_event(message: str, details: dict[str, Any]) -> None:
    """Default event callback for a context that has nobody to report to."""


def _none_confirmed() -> int:
    return 0


@dataclass
class TrainContext:
    """Where this rank runs and how it talks to its driver; the process group already exists."""

    rank: int
    world_size: int
    device: torch.device
    job_id: str
    storage_root: str
    on_metric: Callable[[MetricPoint], None] = _ignore
    on_checkpoint: Callable[[CheckpointRecord], None] = _ignore
    should_stop: Callable[[], bool] = _never
    # Called on every rank, once per attempt, after its first optimizer step.
    on_memory: Callable[[RankMemory], None] = _ignore
    # Workers on each node, in rank order (ranks are contiguous per node); None: all on one node.
    ranks_per_node: tuple[int, ...] | None = None
    # Which formation of the group this is (the driver re-forms it after failures and to grow).
    generation: int = 0
    # Another job's storage root (JobSpec.resume_from): resumed from while this job has no usable checkpoint.
    resume_from_root: str | None = None
    # Rank 0 only: something the job's event log should say (message, details), e.g. a corrupt checkpoint skipped.
    on_event: Callable[[str, dict[str, Any]], None] = _ignore_event
    # The job attempt this run serves: the metric points a checkpoint keeps name it.
    attempt: int = 1
    # Rank 0: how many of the points this run passed to on_metric (counted in order) the control plane has stored.
    # Each checkpoint keeps the others, so the attempt that resumes from it can report them.
    metrics_confirmed: Callable[[], int] = _none_confirmed


@dataclass(frozen=True)
class TrainResult:
    """How the attempt ended: ``loss`` is the last step's global mean (None if this attempt ran no
    step), ``val_loss`` is None when stopped early or without a validation set."""

    step: int
    loss: float | None
    val_loss: float | None
    checkpoint_uri: str | None
    stopped: bool


def run_training(spec: JobSpec, ctx: TrainContext) -> TrainResult:
    """Train ``spec`` to ``spec.train.steps`` (or until any rank's ``should_stop``), resuming from
    the latest committed checkpoint under ``ctx.storage_root``; collective over the process group."""
    dims = ParallelDims.from_spec(spec, ctx.world_size, ctx.ranks_per_node)
    accumulation = _accumulation_steps(spec, ctx.world_size)
    mesh = dims.build_mesh(ctx.device.type)
    _seed_everything(spec.train.seed)
    bundle = build_bundle(spec)
    parameter_count = sum(parameter.numel() for parameter in bundle.model.parameters())
    bundle.model.to(ctx.device)
    base_lr = spec.scaled_lr(ctx.world_size)
    setup = ParallelSetup(spec, dims, mesh, ctx.device, OptimizerConfig(lr=base_lr, weight_decay=spec.train.weight_decay))
    parallel = parallelize(bundle, setup)
    lr_factor = linear_warmup(spec.train.warmup_steps)
    keep_best = spec.checkpoint.keep_best
    if keep_best is not None and keep_best.metric == "val_loss" and bundle.val_dataset is None:
        raise ValueError(f"checkpoint.keep_best.metric 'val_loss' needs a validation set, and model {spec.model!r} has none")

    # Asynchronous saves write over their own gloo group: the training group's collectives must not
    # interleave with the background thread's. It also carries rank 0's choice of resume point.
    save_group = dist.new_group(backend="gloo")
    # One save is in flight at a time (each waits for the last), so its staging buffers can be reused.
    stager = checkpoint_stager(ctx.device)
    step, position, checkpoint_uri = 0, DataPosition(), None
    latest, corrupt = _agreed_resume_point(ctx, save_group)
    if latest is not None:
        began = time.perf_counter()
        progress = load_checkpoint(latest.path, model_parts=parallel.parts, optimizers=parallel.optimizers)
        step, position, checkpoint_uri = progress.step, progress.position, latest.path
        if ctx.rank == 0:
            restore_s = time.perf_counter() - began
            ctx.on_event(f"restored checkpoint step {step} in {restore_s:.2f}s",
                         {"restored_step": step, "restore_s": round(restore_s, 4)})
    if corrupt and ctx.rank == 0:
        resumed = f"resumed from step {latest.step}" if latest is not None else "started from scratch"
        problems = "; ".join(f"checkpoint step {skipped.step} is corrupt ({problem})" for skipped, problem in corrupt)
        ctx.on_event(f"{problems}; {resumed}", {
            "corrupt_checkpoints": [{"step": skipped.step, "uri": skipped.path, "problem": problem} for skipped, problem in corrupt],
            "resumed_from_step": latest.step if latest is not None else 0,
        })
    saved_step = step
    # Rank 0's metric points the control plane has not confirmed storing, as (position in on_metric order, point).
    # Each save keeps them, and an attempt that resumes replays them: its predecessor's driver may have died before
    # forwarding them (or while the control plane was down). Without periodic saves there is nothing to resume from
    # mid-run, so nothing is kept.
    recorded = itertools.count()
    unconfirmed_metrics: list[tuple[int, dict[str, Any]]] = []

    def record_metric(point: MetricPoint) -> None:
        ctx.on_metric(point)
        position = next(recorded)
        if spec.checkpoint.every_steps:  # a replayed point keeps the attempt that ran it
            unconfirmed_metrics.append((position, {"attempt": ctx.attempt} | point.model_dump(exclude_none=True)))

    if latest is not None and ctx.rank == 0 and latest.path == checkpoint_dir(ctx.storage_root, latest.step):
        for point in checkpoint_metrics(latest):  # this job's own history only, not resume_from's
            record_metric(MetricPoint.model_validate(point))

    # A pipeline step feeds `microbatches` micro-batches to the schedule at once.
    batch_size = spec.train.micro_batch_size * (spec.parallel.microbatches if parallel.schedule else 1)
    stream = GlobalBatchStream(
        bundle.train_dataset,
        micro_batch_size=batch_size,
        dp_rank=dims.dp_rank(mesh),
        dp_size=dims.dp,
        seed=spec.train.seed,
        global_batch_size=spec.train.global_batch_size,
        position=position,
        pin_memory=ctx.device.type == "cuda",
    )
    audit = _sample_audit(ctx, dims.dp_rank(mesh)) if spec.train.record_sample_ids else None

    in_flight: PendingSave | None = None  # at most one save is in flight
    save_timing: dict[str, tuple[float, float]] = {}  # path -> (when the save began, seconds training was blocked)
    # The validation loss evaluated at a checkpoint, as (step, value): the end of training reuses it.
    validated_at: tuple[int, float] | None = None

    def validate() -> float:
        """Collective: the validation loss now; rank 0 reports it as the step's val_loss."""
        nonlocal validated_at
        val_loss = evaluate(parallel, bundle.loss_fn, bundle.val_dataset, ctx, autocast,
                            dp_rank=dims.dp_rank(mesh), dp=dims.dp, pipeline_batch_size=batch_size)
        validated_at = (step, val_loss)
        if ctx.rank == 0:
            record_metric(MetricPoint(step=step, val_loss=val_loss, world_size=ctx.world_size))
        return val_loss

    def checkpoint_metric() -> float | None:
        """This checkpoint's value of checkpoint.keep_best's metric (collective for val_loss)."""
        if keep_best is None:
            return None
        return loss if keep_best.metric == "loss" else validate()

    def commit(pending: PendingSave, final: bool) -> None:
        """Rank 0: make a written save visible, then report it with what retention did."""
        committed = commit_save(pending)
        ctx.on_checkpoint(_checkpoint_record(pending, committed, ctx.world_size, final, save_timing[pending.path]))

    def settle(block: bool) -> None:
        """Commit the save in flight once written (rank 0 reports it then); ``block``: wait for it."""
        nonlocal in_flight
        if in_flight is None or not (block or in_flight.done()):
            return
        pending, in_flight = in_flight, None
        pending.wait()
        if ctx.rank == 0:
            commit(pending, final=False)

    def checkpoint(final: bool, asynchronous: bool) -> str:
        nonlocal in_flight
        settle(block=True)
        metric_value = checkpoint_metric()
        confirmed = ctx.metrics_confirmed()
        unconfirmed_metrics[:] = [(position, point) for position, point in unconfirmed_metrics if position >= confirmed]
        kept = [point for _, point in unconfirmed_metrics]
        began = time.perf_counter()
        pending = begin_save(ctx.storage_root, spec, step=step, position=stream.position, model_parts=parallel.parts,
                             optimizers=parallel.optimizers, process_group=save_group if asynchronous else None,
                             metric_value=metric_value, stager=stager, metrics=kept)
        save_timing[pending.path] = (began, time.perf_counter() - began)
        if asynchronous:
            in_flight = pending
        elif ctx.rank == 0:
            commit(pending, final)
        return pending.path

    # FSDP2 modules (fully_shard, replicate) cast to bf16 by their MixedPrecisionPolicy; the rest autocast.
    bf16 = spec.train.precision == "bf16" and not isinstance(parallel.parts[0], FSDPModule)
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16)
    # [sum of this rank's micro-step losses, stop votes]: one all-reduce per step carries both. Only
    # loss-holding ranks (last pipeline stage, first tp rank) add losses, so each counts once.
    step_stats = torch.zeros(2, device=ctx.device)
    loss_sum, stop_votes = step_stats[0], step_stats[1]
    loss_divisor = accumulation * dims.dp
    every = spec.checkpoint.every_steps
    loss, stopped, memory_reported = None, False, False
    for part in parallel.parts:
        part.train()
    while step < spec.train.steps and not stopped:
        settle(block=False)
        started = time.perf_counter()
        step_stats.zero_()
        step_sample_ids: list[int] = []
        for micro_step in range(accumulation):
            batch = _to_device(stream.next_batch(), ctx.device)
            if audit is not None:
                step_sample_ids += stream.last_sample_ids
            # Gradients are synchronised only on the last micro-step; earlier ones accumulate locally.
            with parallel.accumulate_locally() if micro_step < accumulation - 1 else nullcontext():
                micro_loss = _forward_backward(parallel, bundle.loss_fn, batch, accumulation, autocast)
            if micro_loss is not None:
                loss_sum.add_(micro_loss)
        if in_flight is not None:
            in_flight.wait_staged()  # the save's copy of the state must be complete before the optimizer changes it
        for stage in parallel.stages:
            stage.scale_grads(spec.parallel.microbatches * accumulation)  # the schedule left them summed
        if ctx.should_stop():
            stop_votes.fill_(1.0)
        reduction = dist.all_reduce(step_stats, async_op=True)
        lr = base_lr * lr_factor(step)
        for optimizer in parallel.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
        if not memory_reported:
            ctx.on_memory(measure_rank_memory(ctx.rank, parallel, dims, parameter_count))
            memory_reported = True
        for optimizer in parallel.optimizers:
            optimizer.zero_grad(set_to_none=True)
        reduction.wait()
        summed_loss, votes = step_stats.tolist()
        step_time = time.perf_counter() - started
        step += 1
        loss, stopped = summed_loss / loss_divisor, votes > 0 and step < spec.train.steps
        if audit is not None:
            audit.record(step, stream.position.epoch, step_sample_ids)
        if ctx.rank == 0:
            record_metric(
                MetricPoint(
                    step=step,
                    loss=loss,
                    samples_per_s=spec.train.global_batch_size / step_time,
                    step_time_s=step_time,
                    wall_time=time.time(),
                    lr=lr,
                    world_size=ctx.world_size,
                )
            )
        if stopped or (every and step % every == 0 and step < spec.train.steps):
            # Periodic saves run in the background; the one a stop asks for is written before returning.
            checkpoint_uri, saved_step = checkpoint(final=False, asynchronous=not stopped), step

    if audit is not None:
        audit.close()
    settle(block=True)
    if saved_step != step:
        checkpoint_uri = checkpoint(final=True, asynchronous=False)
    stager.close()
    dist.destroy_process_group(save_group)
    if stopped:
        return TrainResult(step, loss, None, checkpoint_uri, stopped=True)
    val_loss = None
    if bundle.val_dataset is not None:
        val_loss = validated_at[1] if validated_at is not None and validated_at[0] == step else validate()
    return TrainResult(step, loss, val_loss, checkpoint_uri, stopped=False)


def _sample_audit(ctx: TrainContext, dp_rank: int) -> SampleAudit:
    """The sample-id record lives in the job's storage root, which must then be a local directory."""
    storage, root = storage_for(ctx.storage_root)
    if not isinstance(storage, LocalStorage):
        raise ValueError(f"train.record_sample_ids writes its record to a local directory, and this job's storage is {ctx.storage_root!r}")
    return SampleAudit(root, ctx.rank, dp_rank, ctx.generation)


def _agreed_resume_point(ctx: TrainContext, group: dist.ProcessGroup) -> tuple[CommittedCheckpoint | None, list[tuple[CommittedCheckpoint, str]]]:
    """Rank 0 chooses the checkpoint to resume from (this job's storage first, then resume_from's) and
    the corrupt ones it skipped, and tells every rank, so all load the same one and storage is read once."""
    choice: list[Any] = [None]
    if ctx.rank == 0:
        latest, corrupt = find_resume_point(ctx.storage_root)
        if latest is None and ctx.resume_from_root is not None:
            latest, corrupt_there = find_resume_point(ctx.resume_from_root)
            corrupt += corrupt_there
        choice = [(latest, corrupt)]
    dist.broadcast_object_list(choice, src=0, group=group)
    return choice[0]


def _checkpoint_record(pending: PendingSave, committed: CommittedSave, world_size: int, final: bool,
                       timing: tuple[float, float]) -> CheckpointRecord:
    started, blocked_s = timing
    return CheckpointRecord(
        step=pending.step, uri=committed.path, world_size=world_size, final=final,
        metric=pending.manifest.get("metric"), metric_value=pending.manifest.get("metric_value"),
        best_uri=committed.retention.best, deleted_uris=committed.retention.deleted,
        blocked_s=round(blocked_s, 4), save_s=round(time.perf_counter() - started, 4),
    )


def _forward_backward(
    parallel: ParallelModel, loss_fn: LossFn, batch: Any, accumulation: int, autocast: torch.autocast
) -> torch.Tensor | None:
    """One micro-step's forward and backward; returns its mean loss where this rank holds losses."""
    if parallel.schedule is not None:
        inputs, targets = batch
        losses: list[torch.Tensor] = []
        with autocast:  # the schedule runs forward and backward together, so both sit inside autocast
            parallel.schedule.step(*_first_stage_inputs(parallel, inputs), target=targets, losses=losses)
        return torch.stack(losses).detach().mean() if parallel.holds_loss else None
    with autocast:
        loss = loss_fn(parallel.parts[0], batch)
    (loss / accumulation).backward()
    return loss.detach() if parallel.holds_loss else None


def _first_stage_inputs(parallel: ParallelModel, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Only the rank holding stage 0 feeds inputs to the schedule; the others receive activations."""
    return (inputs,) if parallel.stages[0].is_first else ()


@torch.no_grad()
def evaluate(
    parallel: ParallelModel, loss_fn: LossFn, dataset: Dataset, ctx: TrainContext, autocast: torch.autocast,
    *, dp_rank: int, dp: int, pipeline_batch_size: int,
) -> float:
    """Mean loss over the validation set, sharded over data-parallel ranks; all ranks run the same
    number of batches (drop_last drops fewer than dp samples) so sharded strategies cannot hang. Under
    a pipeline every batch must have the training shape, so a last partial batch is left out."""
    pipelined = parallel.schedule is not None
    batch_size = pipeline_batch_size if pipelined else VALIDATION_BATCH_SIZE
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, shuffle=False, drop_last=True)
    # A private generator: evaluating between training steps must not draw from the training RNG.
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=pipelined, generator=torch.Generator())
    batch_sizes = (min(batch_size, len(sampler) - start) for start in range(0, len(sampler), batch_size))
    totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # [sum of per-sample losses, samples]
    for part in parallel.parts:
        part.eval()
    for batch, samples in zip(loader, batch_sizes):
        batch = _to_device(batch, ctx.device)
        with autocast:
            if pipelined:
                inputs, targets = batch
                losses: list[torch.Tensor] = []
                parallel.schedule.eval(*_first_stage_inputs(parallel, inputs), target=targets, losses=losses)
                batch_loss = torch.stack(losses).mean() if parallel.holds_loss else None
            else:
                batch_loss = loss_fn(parallel.parts[0], batch)
        if parallel.holds_loss:
            totals[0] += batch_loss.double() * samples
            totals[1] += samples
    for part in parallel.parts:
        part.train()
    dist.all_reduce(totals)
    summed, samples = totals.tolist()
    if samples == 0:
        raise ValueError(
            f"validation set of {len(dataset)} samples holds no full batch of {batch_size} for each of {dp} data-parallel ranks"
        )
    return summed / samples


def linear_warmup(warmup_steps: int) -> Callable[[int], float]:
    """Learning-rate factor before step ``completed_steps + 1``: ramps linearly to 1 over ``warmup_steps``
    (the first step already moves), then stays."""

    def factor(completed_steps: int) -> float:
        return min(1.0, (completed_steps + 1) / warmup_steps) if warmup_steps else 1.0

    return factor


def _accumulation_steps(spec: JobSpec, world_size: int) -> int:
    per_pass = spec.samples_per_micro_step(world_size)
    if spec.train.global_batch_size % per_pass:
        raise ValueError(
            f"global_batch_size {spec.train.global_batch_size} is not a multiple of the {per_pass} samples one "
            f"micro-step takes at world size {world_size} (micro_batch_size × pipeline micro-batches × data-parallel size)"
        )
    return spec.accumulation_steps(world_size)


def _seed_everything(seed: int) -> None:
    """Same seed on every rank: identical model init, and a resumed run restores these RNGs anyway."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: _to_device(value, device) for key, value in batch.items()}
    return batch
