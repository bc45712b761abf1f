"""Pipeline parallel (torch.distributed.pipelining): the model split into stages of contiguous blocks
over the pp mesh, driven by a GPipe, 1F1B or interleaved 1F1B schedule over micro-batches."""

from __future__ import annotations

from typing import Callable

from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ringmaster.workers.models.registry import ModelBundle
from ringmaster.workers.strategies.ddp import wrap_ddp
from ringmaster.workers.strategies.parallel_model import ParallelModel, ParallelSetup

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}


def parallelize_pipeline(bundle: ModelBundle, setup: ParallelSetup) -> ParallelModel:
    """Each stage's data-parallel replicas (if any) synchronise with DDP over dp."""

    def replicate_stage(stage: nn.Module) -> nn.Module:
        return wrap_ddp(stage, setup) if setup.dims.dp > 1 else stage

    return build_pipeline(bundle, setup, replicate_stage)


def build_pipeline(bundle: ModelBundle, setup: ParallelSetup, prepare_stage: Callable[[nn.Module], nn.Module]) -> ParallelModel:
    """Split into pp × (virtual stages per rank) stages, stage i on pp rank i % pp (looped placement);
    ``prepare_stage`` parallelizes each stage module further (TP, then FSDP/DDP) before it is staged.

    Gradients are left summed over micro-batches (scale_grads=False): the loop divides them once per
    optimizer step, which stays right when several schedule steps accumulate into one update."""
    parallel = setup.spec.parallel
    if bundle.pipeline_stage is None or bundle.output_loss_fn is None:
        raise ValueError(
            f"strategy {setup.spec.strategy!r} with parallel.pp = {parallel.pp} needs ModelBundle.pipeline_stage and "
            f"ModelBundle.output_loss_fn, but model {setup.spec.model!r} does not supply both"
        )
    stages_per_rank = parallel.stages_per_rank if parallel.schedule == "interleaved1f1b" else 1
    num_stages = parallel.pp * stages_per_rank
    pp_rank = setup.mesh.get_local_rank("pp")
    indices = [pp_rank + virtual * parallel.pp for virtual in range(stages_per_rank)]
    parts = [prepare_stage(bundle.pipeline_stage(bundle.model, index, num_stages)) for index in indices]
    group = setup.mesh["pp"].get_group()
    stages = [PipelineStage(part, index, num_stages, setup.device, group=group) for part, index in zip(parts, indices)]
    schedule_class = SCHEDULES[parallel.schedule]
    staged = stages if stages_per_rank > 1 else stages[0]
    schedule = schedule_class(staged, parallel.microbatches, loss_fn=bundle.output_loss_fn, scale_grads=False)
    return ParallelModel(
        parts=parts,
        optimizers=[setup.optimizer.build(part.parameters()) for part in parts],
        holds_loss=stages[-1].is_last and setup.mesh.get_local_rank("tp") == 0,
        schedule=schedule,
        stages=stages,
    )
