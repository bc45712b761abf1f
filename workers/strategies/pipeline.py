"""Pipeline parallel (torch.distributed.pipelining): the model split into stages of contiguous blocks over the pp
mesh, driven by a GPipe, 1F1B or interleaved 1F1B schedule over micro-batches."""

from __future__ import annotations

from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from ringmaster.workers.models.registry import ModelBundle
from ringmaster.workers.strategies.parallel_model import ParallelSetup

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}


def split_stages(bundle: ModelBundle, setup: ParallelSetup) -> tuple[list[int], list[nn.Module]]:
    """This rank's stages of pp × (virtual stages per rank): stage i sits on pp rank i % pp (looped placement).
    Returns their indices and modules, each holding its blocks under the unsplit model's names."""
    parallel = setup.spec.parallel
    if bundle.pipeline_stage is None or bundle.output_loss_fn is None:
        raise ValueError(
            f"strategy {setup.spec.strategy!r} with parallel.pp = {parallel.pp} needs ModelBundle.pipeline_stage and "
            f"ModelBundle.output_loss_fn, but model {setup.spec.model!r} does not supply both"
        )
    pp_rank = setup.mesh.get_local_rank("pp")
    indices = [pp_rank + virtual * parallel.pp for virtual in range(_stages_per_rank(setup))]
    num_stages = parallel.pp * _stages_per_rank(setup)
    return indices, [bundle.pipeline_stage(bundle.model, index, num_stages) for index in indices]


def build_schedule(parts: list[nn.Module], indices: list[int], bundle: ModelBundle, setup: ParallelSetup
                   ) -> tuple[PipelineScheduleSingle | PipelineScheduleMulti, list[PipelineStage]]:
    """Stage the (already parallelized) parts and drive them with the spec's schedule.

    Gradients are left summed over micro-batches (scale_grads=False): the trainer divides them once per optimizer
    step, which stays right when several schedule steps accumulate into one update."""
    parallel = setup.spec.parallel
    num_stages = parallel.pp * _stages_per_rank(setup)
    group = setup.mesh["pp"].get_group()
    stages = [PipelineStage(part, index, num_stages, setup.device, group=group) for part, index in zip(parts, indices)]
    staged = stages if len(stages) > 1 else stages[0]
    schedule = SCHEDULES[parallel.schedule](staged, parallel.microbatches, loss_fn=bundle.output_loss_fn, scale_grads=False)
    return schedule, stages


def _stages_per_rank(setup: ParallelSetup) -> int:
    parallel = setup.spec.parallel
    return parallel.stages_per_rank if parallel.schedule == "interleaved1f1b" else 1
