"""The training loop one rank runs inside an already-initialised torch.distributed process group.

It knows nothing of Ray or the control plane: progress leaves through ``TrainContext`` callbacks
(rank 0 only), and a retried attempt continues from the latest committed checkpoint.
"""

from __future__ import annotations

import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from service.reports import CheckpointRecord, MetricPoint
from service.spec import JobSpec
from workers.checkpoint import latest_committed, load_checkpoint, save_checkpoint
from workers.data.stream import DataPosition, ShardedBatchStream
from workers.models import build_bundle
from workers.models.registry import LossFn
from workers.strategies import parallelize

VALIDATION_BATCH_SIZE = 64  # no backward pass, so larger than a training micro-batch is cheap


def _ignore(_: Any) -> None:
    """Default callback for a context that has nobody to report to."""


def _never() -> bool:
    return False


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
    accumulation = _accumulation_steps(spec, ctx.world_size)
    _seed_everything(spec.train.seed)
    bundle = build_bundle(spec)
    model = parallelize(spec.strategy, bundle.model.to(ctx.device), ctx.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.scaled_lr(ctx.world_size), weight_decay=spec.train.weight_decay)
    scheduler = LambdaLR(optimizer, linear_warmup(spec.train.warmup_steps))

    step, position, checkpoint_uri = 0, DataPosition(), None
    latest = latest_committed(ctx.storage_root)
    if latest is not None:
        progress = load_checkpoint(latest.path, model=model, optimizer=optimizer, scheduler=scheduler)
        step, position, checkpoint_uri = progress.step, progress.position, str(latest.path)
    saved_step = step

    stream = ShardedBatchStream(
        bundle.train_dataset,
        spec.train.micro_batch_size,
        ctx.rank,
        ctx.world_size,
        spec.train.seed,
        position,
        pin_memory=ctx.device.type == "cuda",
    )

    def checkpoint(final: bool) -> str:
        path = save_checkpoint(
            ctx.storage_root, spec, step=step, position=stream.position, model=model, optimizer=optimizer, scheduler=scheduler
        )
        if ctx.rank == 0:
            ctx.on_checkpoint(CheckpointRecord(step=step, uri=str(path), world_size=ctx.world_size, final=final))
        return str(path)

    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=spec.train.precision == "bf16")
    # [sum of this rank's micro-batch losses, stop votes]: one all-reduce per step carries both.
    step_stats = torch.zeros(2, device=ctx.device)
    loss_sum, stop_votes = step_stats[0], step_stats[1]
    loss_divisor = accumulation * ctx.world_size
    every = spec.checkpoint.every_steps
    loss, stopped = None, False
    model.train()
    while step < spec.train.steps and not stopped:
        started = time.perf_counter()
        step_stats.zero_()
        for micro_step in range(accumulation):
            batch = _to_device(stream.next_batch(), ctx.device)
            # Gradients are all-reduced only on the last micro-batch; earlier ones accumulate locally.
            with model.no_sync() if micro_step < accumulation - 1 else nullcontext():
                with autocast:
                    micro_loss = bundle.loss_fn(model, batch)
                (micro_loss / accumulation).backward()
            loss_sum.add_(micro_loss.detach())
        if ctx.should_stop():
            stop_votes.fill_(1.0)
        reduction = dist.all_reduce(step_stats, async_op=True)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        reduction.wait()
        summed_loss, votes = step_stats.tolist()
        step_time = time.perf_counter() - started
        step += 1
        loss, stopped = summed_loss / loss_divisor, votes > 0 and step < spec.train.steps
        if ctx.rank == 0:
            ctx.on_metric(
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
            checkpoint_uri, saved_step = checkpoint(final=False), step

    if stopped:
        return TrainResult(step, loss, None, checkpoint_uri, stopped=True)
    if saved_step != step:
        checkpoint_uri = checkpoint(final=True)
    val_loss = None
    if bundle.val_dataset is not None:
        val_loss = evaluate(model, bundle.loss_fn, bundle.val_dataset, ctx, autocast)
        if ctx.rank == 0:
            ctx.on_metric(MetricPoint(step=step, val_loss=val_loss, world_size=ctx.world_size))
    return TrainResult(step, loss, val_loss, checkpoint_uri, stopped=False)


@torch.no_grad()
def evaluate(model: nn.Module, loss_fn: LossFn, dataset: Dataset, ctx: TrainContext, autocast: torch.autocast) -> float:
    """Mean loss over the validation set, sharded over ranks; all ranks run the same number of
    batches (drop_last drops fewer than world_size samples) so sharded strategies cannot hang."""
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False, drop_last=True)
    loader = DataLoader(dataset, batch_size=VALIDATION_BATCH_SIZE, sampler=sampler)
    batch_sizes = (min(VALIDATION_BATCH_SIZE, len(sampler) - start) for start in range(0, len(sampler), VALIDATION_BATCH_SIZE))
    totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # [sum of per-sample losses, samples]
    model.eval()
    for batch, samples in zip(loader, batch_sizes):
        with autocast:
            batch_loss = loss_fn(model, _to_device(batch, ctx.device))
        totals[0] += batch_loss.double() * samples
        totals[1] += samples
    model.train()
    dist.all_reduce(totals)
    summed, samples = totals.tolist()
    if samples == 0:
        raise ValueError(f"validation set of {len(dataset)} samples is smaller than the world size {ctx.world_size}")
    return summed / samples


def linear_warmup(warmup_steps: int) -> Callable[[int], float]:
    """LambdaLR factor: ramps linearly to 1 over ``warmup_steps`` (the first step already moves), then stays."""

    def factor(completed_steps: int) -> float:
        return min(1.0, (completed_steps + 1) / warmup_steps) if warmup_steps else 1.0

    return factor


def _accumulation_steps(spec: JobSpec, world_size: int) -> int:
    per_pass = spec.train.micro_batch_size * world_size
    if spec.train.global_batch_size % per_pass:
        raise ValueError(
            f"global_batch_size {spec.train.global_batch_size} is not a multiple of micro_batch_size × world size = {per_pass}"
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
