"""The training loop one rank runs inside an already-initialised torch.distributed process group.

`Trainer` builds the parallel model once and runs short steps; its components each do one job and do not reach into
each other: the data stream (workers/data/stream.py), the optimizer step and LR schedule, the checkpointer, the
validator, and the rank's metric ledger, which sends what leaves the rank through the context's one sink. The
trainer knows nothing of Ray or the control plane, and a retried attempt continues from the latest committed
checkpoint. The strategy decides how the model is split; the trainer only runs micro-steps on what it was handed.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import Dataset

from ringmaster.service.reports import VALIDATION_PREFIX, MetricPoint
from ringmaster.service.spec import DataSourceSpec, JobSpec
from ringmaster.workers.checkpoint import Checkpointer
from ringmaster.workers.checkpoint.snapshots.live_state import LiveStateSnapshots
from ringmaster.workers.checkpoint.snapshots.peer_snapshots import PeerSnapshots
from ringmaster.workers.checkpoint.snapshots.step_snapshots import NoSnapshots, StepEnd, StepSnapshots
from ringmaster.workers.checkpoint.storage import LocalStorage, storage_for
from ringmaster.workers.data.audit import SampleAudit
from ringmaster.workers.data.stream import GlobalBatchStream
from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.measured_state import measure_rank_memory
from ringmaster.workers.metric_ledger import RankMetrics
from ringmaster.workers.models import build_bundle
from ringmaster.workers.models.registry import LossFn
from ringmaster.workers.parallel_dims import ParallelDims
from ringmaster.workers.strategies import OptimizerConfig, ParallelModel, ParallelSetup, parallelize
from ringmaster.workers.strategies.decisions import summary
from ringmaster.workers.strategies.param_groups import GroupRule, check_rules_match
from ringmaster.workers.trainer.batches import first_stage_inputs, to_device
from ringmaster.workers.trainer.context import TrainContext, TrainResult
from ringmaster.workers.trainer.optimizer_step import OptimizerStep, lr_schedule
from ringmaster.workers.trainer.user_metrics import PipelineLossMetrics, StepUserMetrics, split_loss
from ringmaster.workers.trainer.validator import Evaluation, Validator

_BUILT_IN_STATS = 3  # the step's all-reduced loss sum and votes, before the user's metrics' sums


class Trainer:
    def __init__(self, spec: JobSpec, ctx: TrainContext) -> None:
        """Collective: build the mesh, the model and its strategy, and the components the loop calls."""
        self.spec, self.ctx = spec, ctx
        dims = ParallelDims.from_spec(spec, ctx.world_size, ctx.ranks_per_node)
        self._accumulation = _accumulation_steps(spec, ctx.world_size)
        mesh = dims.build_mesh(ctx.device.type)
        _seed_everything(spec.train.seed)
        bundle = build_bundle(spec)
        keep_best = spec.checkpoint.keep_best
        if keep_best is not None and keep_best.metric.startswith(VALIDATION_PREFIX) and bundle.val_dataset is None:
            raise JobInputError(
                f"checkpoint.keep_best.metric {keep_best.metric!r} needs a validation set, and model {spec.model!r} "
                "has none"
            )
        if spec.train.eval_every_steps and bundle.val_dataset is None:
            raise JobInputError(f"train.eval_every_steps needs a validation set, and model {spec.model!r} has none")
        self._parameter_count = sum(parameter.numel() for parameter in bundle.model.parameters())
        bundle.model.to(ctx.device)
        base_lr = spec.scaled_lr(ctx.world_size)
        chosen = spec.train.optimizer
        optimizer = OptimizerConfig(
            lr=base_lr,
            weight_decay=spec.train.effective_weight_decay,
            name=chosen.name,
            betas=chosen.betas,
            eps=chosen.eps,
            no_decay_auto=chosen.no_decay == "auto",
            groups=tuple(GroupRule(tuple(g.params), g.weight_decay, g.lr_scale) for g in chosen.groups),
        )
        check_rules_match(bundle.model, optimizer.groups)
        self._pipeline_metrics = PipelineLossMetrics()
        if bundle.output_loss_fn is not None:
            bundle.output_loss_fn = self._pipeline_metrics.wrap(bundle.output_loss_fn)
        self.parallel = parallelize(bundle, ParallelSetup(spec, dims, mesh, ctx.device, optimizer))
        if ctx.rank == 0:
            ctx.sink.event(summary(self.parallel.decisions), {"parallel_layout": self.parallel.decisions})
        self._dims, self._dp_rank = dims, dims.dp_rank(mesh)
        self._bundle = bundle
        self._optimizer = OptimizerStep(
            self.parallel.optimizers,
            base_lr,
            lr_schedule(spec.train),
            spec.train.grad_clip,
            pipeline_group=mesh["pp"].get_group() if dims.pp > 1 else None,
            counted_elsewhere=[copy for tied in self.parallel.tied for copy in tied.duplicates],
        )
        self._snapshots = _step_snapshots(spec, ctx, self.parallel)
        self._metrics = RankMetrics(
            ctx.attempt,
            ctx.sink.metric,
            ctx.sink.metrics_acknowledged,
            keep_for_checkpoints=bool(spec.checkpoint.every_steps) or self._snapshots.takes_snapshots,
        )
        self._checkpointer = Checkpointer(spec, ctx, self.parallel, self._metrics)
        # FSDP2 modules (fully_shard, replicate) cast to bf16 by their MixedPrecisionPolicy; the rest autocast.
        bf16 = spec.train.precision == "bf16" and not isinstance(self.parallel.parts[0], FSDPModule)
        self._autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16)
        # A pipeline step feeds `microbatches` micro-batches to the schedule at once.
        self._batch_size = spec.train.micro_batch_size * (spec.parallel.microbatches if self.parallel.schedule else 1)
        self._validator = (
            None
            if bundle.val_dataset is None
            else Validator(
                self.parallel,
                bundle.loss_fn,
                bundle.val_dataset,
                ctx.device,
                self._autocast,
                dp_rank=self._dp_rank,
                dp=dims.dp,
                micro_batch_size=spec.train.micro_batch_size,
                microbatches=spec.parallel.microbatches,
                num_workers=_data_workers(spec),
                pipeline_metrics=self._pipeline_metrics,
            )
        )
        # [sum of this rank's micro-step losses, stop votes, votes for a full snapshot, then the sum of each of the
        # user's metrics]: one all-reduce per step carries them. Only loss-holding ranks (last pipeline stage, first tp
        # rank) add losses and metrics, so each counts once.
        self._step_stats = torch.zeros(_BUILT_IN_STATS, device=ctx.device)
        self._user_metrics = StepUserMetrics(ctx.device)
        self._newest_user_metrics: dict[str, float] = {}  # the newest step's, for keep_best by one of them
        self._reduced_stats: list[float] = []  # the step's all-reduced stats, on the host
        self._memory_reported = False
        self.step = 0
        self.loss: float | None = None

    def train(self) -> TrainResult:
        """Train to ``spec.train.steps`` (or until the driver asks any rank to stop), resuming from the latest
        committed checkpoint; collective over the process group."""
        spec, ctx = self.spec, self.ctx
        restored = self._checkpointer.restore()
        self._snapshots.after_restore()
        self.step = restored.step
        self._stream = GlobalBatchStream(
            cast(Dataset[Any], self._bundle.train_dataset),  # build_bundle raised without one
            micro_batch_size=self._batch_size,
            dp_rank=self._dp_rank,
            dp_size=self._dims.dp,
            seed=spec.train.seed,
            global_batch_size=spec.train.global_batch_size,
            position=restored.position,
            pin_memory=ctx.device.type == "cuda",
            num_workers=_data_workers(spec),
        )
        try:
            result = self._train_from_restored()
        except BaseException:
            self._snapshots.training_failed()
            raise
        finally:
            self._stream.close()
        self._snapshots.training_ended(stopped=result.stopped)
        return result

    def _train_from_restored(self) -> TrainResult:
        spec = self.spec
        self._audit = self._sample_audit() if spec.train.record_sample_ids else None
        for part in self.parallel.parts:
            part.train()
        stopped = False
        while self.step < spec.train.steps and not stopped:
            self._checkpointer.settle(block=False)
            stopped = self.train_step()
            saving = stopped or self._checkpointer.due(self.step)
            if self._validation_due(saving):
                self._validate()
            self._metrics.release()
            if saving:
                # Periodic saves run in the background; the one a stop asks for is written before returning.
                self._checkpointer.save(
                    self.step, self._stream.position, self._checkpoint_metric, final=False, asynchronous=not stopped
                )
        if self._audit is not None:
            self._audit.close()
        self._checkpointer.settle(block=True)
        if self._checkpointer.saved_step != self.step:
            self._checkpointer.save(
                self.step, self._stream.position, self._checkpoint_metric, final=True, asynchronous=False
            )
        self._checkpointer.close()
        uri = self._checkpointer.latest_uri
        if stopped:
            return TrainResult(self.step, self.loss, None, uri, stopped=True)
        # The last step's, evaluated in the loop.
        val_loss = self._validate().loss if self._validator is not None else None
        return TrainResult(self.step, self.loss, val_loss, uri, stopped=False)

    def train_step(self) -> bool:
        """One optimizer step over `accumulation` micro-steps, and its snapshot; rank 0 records its metrics. True: the
        driver asked the group to stop after it (and it was not the last step)."""
        started = time.perf_counter()
        self._step_stats.zero_()
        loss_sum = self._step_stats[0]
        sample_ids: list[int] = []
        for micro_step in range(self._accumulation):
            batch = to_device(self._stream.next_batch(), self.ctx.device)
            if self._audit is not None:
                sample_ids += self._stream.last_sample_ids
            # Gradients are synchronised only on the last micro-step; earlier ones accumulate locally.
            with self.parallel.accumulate_locally() if micro_step < self._accumulation - 1 else nullcontext():
                micro = _forward_backward(
                    self.parallel,
                    self._bundle.loss_fn,
                    self._pipeline_metrics,
                    batch,
                    self._accumulation,
                    self._autocast,
                )
            if micro is not None:
                loss_sum.add_(micro[0])
                self._user_metrics.add(micro[1])
        self._step_stats = self._user_metrics.into(self._step_stats, _BUILT_IN_STATS)
        self._check_keep_best_metric()
        self._checkpointer.before_state_changes()
        self._snapshots.before_state_changes()
        for stage in self.parallel.stages:
            stage.scale_grads(self.spec.parallel.microbatches * self._accumulation)  # the schedule left them summed
        for tied in self.parallel.tied:
            tied.sync_gradients()
        if self.ctx.sink.stop_requested():
            self._step_stats[1].fill_(1.0)
        self._optimizer.clip()
        completed = self.step
        # The snapshots put the step's end in the order they need (StepSnapshots.end_step).
        return self._snapshots.end_step(
            StepEnd(
                step=completed + 1,
                position=self._stream.position,
                last=completed + 1 >= self.spec.train.steps,
                reduce=self._reduce_step_stats,
                reduce_during_update=lambda: self._reduce_step_stats_during_update(completed),
                update=lambda: self._update(completed),
                close=lambda: self._close_step(started, self._optimizer.lr(completed), sample_ids),
                metrics=self._metrics_for_snapshot,
            )
        )

    def _reduce_step_stats(self, structure_changed: bool) -> bool:
        """The step's all-reduce, with this rank's vote that its state left the snapshots' layout; returns whether
        any rank voted so."""
        self._step_stats[2] = float(structure_changed)
        dist.all_reduce(self._step_stats)
        self._reduced_stats = self._step_stats.tolist()
        return self._reduced_stats[2] > 0

    def _reduce_step_stats_during_update(self, completed_steps: int) -> None:
        """The step's all-reduce (no vote), overlapping the optimizer update."""
        reduction = dist.all_reduce(self._step_stats, async_op=True)
        self._update(completed_steps)
        reduction.wait()
        self._reduced_stats = self._step_stats.tolist()

    def _close_step(self, started: float, lr: float, sample_ids: list[int]) -> bool:
        """Count the step: its loss and votes from the step's all-reduce, its samples in the audit, rank 0's metric
        point. True: the driver asked the group to stop after it (and it was not the last step)."""
        summed_loss, votes = self._reduced_stats[:2]
        step_time = time.perf_counter() - started
        self.step += 1
        self.loss = summed_loss / (self._accumulation * self._dims.dp)
        user_metrics = self._user_metrics.means(
            self._reduced_stats[_BUILT_IN_STATS:], self._accumulation * self._dims.dp
        )
        self._newest_user_metrics = user_metrics or {}
        if not math.isfinite(self.loss):
            # The all-reduced sum is NaN or infinite on every rank alike, so every rank stops here, before this step
            # reaches a snapshot or a checkpoint; a save of an earlier step still in flight is committed first.
            self._checkpointer.settle(block=True)
            raise JobInputError(
                f"training diverged: the loss was {self.loss} at step {self.step}, and the weights after it are not "
                f"usable; the job stopped there, and its checkpoints hold only earlier steps. A smaller train.lr, "
                f"more train.warmup_steps or a train.grad_clip usually keeps the loss finite"
            )
        if self._audit is not None:
            self._audit.record(self.step, self._stream.position.epoch, sample_ids)
        if self.ctx.rank == 0:
            self._metrics.record(
                MetricPoint(
                    step=self.step,
                    loss=self.loss,
                    samples_per_s=self.spec.train.global_batch_size / step_time,
                    step_time_s=step_time,
                    wall_time=time.time(),
                    lr=lr,
                    grad_norm=cast(torch.Tensor, self._optimizer.grad_norm).item(),  # clip() took it this step
                    world_size=self.ctx.world_size,
                    user_metrics=user_metrics,
                ),
                hold=True,
            )  # sent with the step's validation, if it has one
        return votes > 0 and self.step < self.spec.train.steps

    def _update(self, completed_steps: int) -> None:
        """The optimizer update after the gradients' clipping (this rank's memory reported after its first)."""
        self._optimizer.update(completed_steps)
        if not self._memory_reported:
            self.ctx.sink.memory(measure_rank_memory(self.ctx.rank, self.parallel, self._dims, self._parameter_count))
            self._memory_reported = True
        self._optimizer.zero_grad()

    def _metrics_for_snapshot(self) -> str | None:
        return self._metrics.for_checkpoint_json() if self.ctx.rank == 0 else None

    def _validation_due(self, saving: bool) -> bool:
        """Whether to evaluate after this step, before its metric point is sent (which then carries the values): every
        train.eval_every_steps, after the last step, and where checkpoint.keep_best chooses by val_loss or another
        val_<name>, at a save."""
        if self._validator is None:
            return False
        every, keep_best = self.spec.train.eval_every_steps, self.spec.checkpoint.keep_best
        return (
            (bool(every) and self.step % every == 0)
            or self.step == self.spec.train.steps
            or (saving and keep_best is not None and keep_best.metric.startswith(VALIDATION_PREFIX))
        )

    def _validate(self) -> Evaluation:
        """Collective: the validation now (reused if this step was validated); rank 0 reports a new one, its loss as
        val_loss and each of the user's metrics as val_<name>, which join the step's held point."""
        # Called only with a validator: __init__ raised where keep_best needs one and there is none.
        evaluation, evaluated = cast(Validator, self._validator).at(self.step)
        if evaluated:
            self._check_keep_best_validation_metric()
        if evaluated and self.ctx.rank == 0:
            own = {f"{VALIDATION_PREFIX}{name}": value for name, value in evaluation.user_metrics.items()}
            self._metrics.record(
                MetricPoint(
                    step=self.step,
                    val_loss=evaluation.loss,
                    world_size=self.ctx.world_size,
                    user_metrics=own or None,
                )
            )
        return evaluation

    def _checkpoint_metric(self) -> float | None:
        """This checkpoint's value of checkpoint.keep_best's metric (collective for val_loss and val_<name>); None for
        one of the loss_fn's own that the newest step or validation left out (not finite) or that no step of this
        training call reported."""
        keep_best = self.spec.checkpoint.keep_best
        if keep_best is None:
            return None
        if keep_best.metric == "loss":
            return self.loss
        if keep_best.metric == "val_loss":
            return self._validate().loss
        if keep_best.metric.startswith(VALIDATION_PREFIX):
            return self._validate().user_metrics.get(keep_best.metric.removeprefix(VALIDATION_PREFIX))
        return self._newest_user_metrics.get(keep_best.metric)

    def _check_keep_best_metric(self) -> None:
        """checkpoint.keep_best may name a metric of the loss_fn's own, which every rank knows once the first step
        agreed on their names; a val_<name> is checked at the first validation."""
        keep_best = self.spec.checkpoint.keep_best
        names = self._user_metrics.names
        if keep_best is None or keep_best.metric.startswith(VALIDATION_PREFIX) or keep_best.metric in ("loss", *names):
            return
        returned = f"the metrics {list(names)}" if names else "no metrics of its own"
        raise JobInputError(
            f"checkpoint.keep_best.metric {keep_best.metric!r} is neither loss, val_loss, a metric the model's loss_fn "
            f"returns nor val_<one of those> (it returns {returned}, as (loss, {{name: value}}))"
        )

    def _check_keep_best_validation_metric(self) -> None:
        """checkpoint.keep_best may name val_<name> for a metric the loss_fn returns on the validation set, whose
        names every rank knows alike once an evaluation agreed on them."""
        keep_best = self.spec.checkpoint.keep_best
        if keep_best is None or keep_best.metric == "val_loss" or not keep_best.metric.startswith(VALIDATION_PREFIX):
            return
        names = cast(Validator, self._validator).user_metric_names
        if keep_best.metric.removeprefix(VALIDATION_PREFIX) not in names:
            returned = f"the metrics {list(names)}" if names else "no metrics of its own"
            raise JobInputError(
                f"checkpoint.keep_best.metric {keep_best.metric!r} is neither val_loss nor val_<name> for a metric the "
                f"model's loss_fn returns on the validation set (it returns {returned} there, as (loss, "
                "{name: value}))"
            )

    def _sample_audit(self) -> SampleAudit:
        """The sample-id record lives in the job's storage root, which must then be a local directory."""
        storage, root = storage_for(self.ctx.storage_root)
        if not isinstance(storage, LocalStorage):
            raise JobInputError(
                f"train.record_sample_ids writes its record to a local directory, and this job's storage "
                f"is {self.ctx.storage_root!r}"
            )
        return SampleAudit(root, self.ctx.rank, self._dp_rank, self.ctx.generation)


def _step_snapshots(spec: JobSpec, ctx: TrainContext, parallel: ParallelModel) -> StepSnapshots:
    """The in-memory snapshots this group takes (checkpoint.in_memory): none on one node; the live state itself where
    every rank holds all of it (ddp); else copies on buddies."""
    replicas = spec.checkpoint.in_memory_replicas(nodes=len(ctx.ranks_per_node) if ctx.ranks_per_node else 1)
    if replicas is None or ctx.snapshot_store is None:
        return NoSnapshots(ctx.snapshot_store, ctx.job_id)
    kind = LiveStateSnapshots if parallel.state_replicated else PeerSnapshots
    return kind(
        ctx.snapshot_store,
        ctx.job_id,
        ctx.generation,
        replicas,
        ctx.ranks_per_node,
        ctx.device,
        model_parts=parallel.parts,
        optimizers=parallel.optimizers,
        report=ctx.sink.event if ctx.rank == 0 else None,
    )


def run_training(spec: JobSpec, ctx: TrainContext) -> TrainResult:
    """Build a Trainer for this rank and train; collective over the process group."""
    return Trainer(spec, ctx).train()


def _forward_backward(
    parallel: ParallelModel,
    loss_fn: LossFn,
    pipeline_metrics: PipelineLossMetrics,
    batch: Any,
    accumulation: int,
    autocast: torch.autocast,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """One micro-step's forward and backward; returns its mean loss and the user's metrics (each its mean) where this
    rank holds losses."""
    if parallel.schedule is not None:
        inputs, targets = batch
        losses: list[torch.Tensor] = []
        pipeline_metrics.clear()
        with autocast:  # the schedule runs forward and backward together, so both sit inside autocast
            parallel.schedule.step(*first_stage_inputs(parallel, inputs), target=targets, losses=losses)
        metrics = pipeline_metrics.mean(len(losses))
        return (torch.stack(losses).detach().mean(), metrics) if parallel.holds_loss else None
    with autocast:
        loss, metrics = split_loss(loss_fn(parallel.parts[0], batch))
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise JobInputError(_not_a_loss(loss))
    (loss / accumulation).backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
    return (loss.detach(), metrics) if parallel.holds_loss else None


def _not_a_loss(returned: Any) -> str:
    """Why what a model's loss_fn returned cannot be trained on, in the words of its author's code."""
    if not isinstance(returned, torch.Tensor):
        what = f"a {type(returned).__name__}"
    elif returned.numel() != 1:
        what = f"a tensor of shape {tuple(returned.shape)}"
    else:
        what = "a tensor that autograd does not track (made under torch.no_grad, or with .detach() or .item())"
    return (
        f"the model's loss_fn returned {what}: it must return the batch's mean loss, one number as a tensor that "
        f"autograd tracks (for per-sample losses, their .mean()), alone or as (loss, {{name: metric}})"
    )


def _data_workers(spec: JobSpec) -> int:
    """DataLoader worker processes per rank: a data source's num_workers; built-in corpora are read in-process."""
    return spec.data.num_workers if isinstance(spec.data, DataSourceSpec) else 0


def _accumulation_steps(spec: JobSpec, world_size: int) -> int:
    per_pass = spec.samples_per_micro_step(world_size)
    if spec.train.global_batch_size % per_pass:
        raise JobInputError(
            f"global_batch_size {spec.train.global_batch_size} is not a multiple of the {per_pass} samples one "
            f"micro-step takes at world size {world_size} "
            "(micro_batch_size × pipeline micro-batches × data-parallel size)"
        )
    return spec.accumulation_steps(world_size)


def _seed_everything(seed: int) -> None:
    """Same seed on every rank: identical model init, and a resumed run restores these RNGs anyway."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
