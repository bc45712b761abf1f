"""Pipeline parallel (torch.distributed.pipelining): the model split into stages of contiguous blocks over the pp
mesh, driven by a GPipe, 1F1B or interleaved 1F1B schedule over micro-batches."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.nn.parallel import DistributedDataParallel

from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.models.registry import ModelBundle
from ringmaster.workers.strategies.blocks import named_model
from ringmaster.workers.strategies.chain_stages import chain_pipeline_stage
from ringmaster.workers.strategies.parallel_model import ParallelSetup, local_tensor

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}


def split_stages(bundle: ModelBundle, setup: ParallelSetup) -> tuple[list[int], list[nn.Module]]:
    """This rank's stages of pp × (virtual stages per rank): stage i sits on pp rank i % pp (looped placement).
    Returns their indices and modules, each holding its blocks under the unsplit model's names. A model without a
    pipeline_stage hook is split as the chain embeddings → blocks → head where that gives its own output."""
    parallel = setup.spec.parallel
    num_stages = parallel.pp * _stages_per_rank(setup)
    if bundle.pipeline_stage is None and bundle.output_loss_fn is not None:
        bundle.pipeline_stage = chain_pipeline_stage(bundle, num_stages)
    if bundle.pipeline_stage is None or bundle.output_loss_fn is None:
        raise JobInputError(
            f"strategy {setup.spec.strategy!r} with parallel.pp = {parallel.pp} needs ModelBundle.pipeline_stage and "
            f"ModelBundle.output_loss_fn, but model {setup.spec.model!r}, a {named_model(bundle.model)}, does not "
            "supply both"
        )
    pp_rank = setup.mesh.get_local_rank("pp")
    indices = [pp_rank + virtual * parallel.pp for virtual in range(_stages_per_rank(setup))]
    return indices, [bundle.pipeline_stage(bundle.model, index, num_stages) for index in indices]


def build_schedule(
    parts: list[nn.Module], indices: list[int], bundle: ModelBundle, setup: ParallelSetup
) -> tuple[PipelineScheduleSingle | PipelineScheduleMulti, list[PipelineStage]]:
    """Stage the (already parallelized) parts and drive them with the spec's schedule.

    Gradients are left summed over micro-batches (scale_grads=False): the trainer divides them once per optimizer
    step, which stays right when several schedule steps accumulate into one update."""
    parallel = setup.spec.parallel
    num_stages = parallel.pp * _stages_per_rank(setup)
    group = setup.mesh["pp"].get_group()
    stages = [PipelineStage(part, index, num_stages, setup.device, group=group) for part, index in zip(parts, indices)]
    staged = stages if len(stages) > 1 else stages[0]
    schedule = SCHEDULES[parallel.schedule](
        staged, parallel.microbatches, loss_fn=bundle.output_loss_fn, scale_grads=False
    )
    return schedule, stages


def _stages_per_rank(setup: ParallelSetup) -> int:
    parallel = setup.spec.parallel
    return parallel.stages_per_rank if parallel.schedule == "interleaved1f1b" else 1


@dataclass(frozen=True)
class SharedParameter:
    names: list[str]  # first name first
    shape: torch.Size


def shared_parameters(model: nn.Module) -> list[SharedParameter]:
    """Each parameter the model holds under several names (tied embeddings)."""
    names: dict[int, list[str]] = defaultdict(list)
    shapes: dict[int, torch.Size] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names[id(parameter)].append(name)
        shapes[id(parameter)] = parameter.shape
    return [SharedParameter(group, shapes[key]) for key, group in names.items() if len(group) > 1]


@dataclass
class TiedAcrossStages:
    """A parameter the unsplit model shares between modules that different pipeline stages hold (GPT-2's lm_head and
    wte): each holding stage trains its own copy, and summing the copies' gradients over the pipeline group before
    every update keeps them equal, as one shared parameter would be trained."""

    copies: list[nn.Parameter]  # this rank's
    duplicates: list[nn.Parameter]  # the copies held under a later name: the gradient norm counts the parameter once
    shape: torch.Size
    device: torch.device
    group: dist.ProcessGroup

    def sync_gradients(self) -> None:
        grads = [local_tensor(copy.grad) for copy in self.copies if copy.grad is not None]
        total = torch.stack(grads).sum(0) if grads else torch.zeros(self.shape, device=self.device)
        dist.all_reduce(total, group=self.group)
        for grad in grads:
            grad.copy_(total)


def tied_across_stages(
    shared: list[SharedParameter], parts: list[nn.Module], setup: ParallelSetup
) -> list[TiedAcrossStages]:
    """Collective over the pipeline group: which shared parameters the stages hold apart, and this rank's copies."""
    tied = []
    for parameter in shared:
        names = parameter.names
        held = {name: parameter for part in parts for name, parameter in _named_parameters(part) if name in names}
        holders = [None] * setup.mesh["pp"].size()
        dist.all_gather_object(holders, sorted(held), group=setup.mesh["pp"].get_group())
        if sum(bool(holder) for holder in holders) < 2:
            continue  # one stage holds every name: the parameter stays shared inside it
        copies = list(held.values())
        if not copies and setup.dims.dp > 1 and setup.spec.strategy == "3d":
            raise JobInputError(
                f"{names} are one parameter held by the first and last of {setup.dims.pp} pipeline stages, "
                "which the stages between cannot relay while FSDP shards it; use parallel.pp = 2 or untie it"
            )
        shape = local_tensor(copies[0]).shape if copies else parameter.shape
        tied.append(
            TiedAcrossStages(
                copies,
                [held[name] for name in names[1:] if name in held],
                shape,
                setup.device,
                setup.mesh["pp"].get_group(),
            )
        )
    return tied


def _named_parameters(part: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    module = part.module if isinstance(part, DistributedDataParallel) else part
    return module.named_parameters(remove_duplicate=False)
