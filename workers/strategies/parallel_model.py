"""The contract between strategies and the training loop: what goes in (the setup) and what comes out."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from ringmaster.service.spec import JobSpec
from ringmaster.workers.parallel_dims import ParallelDims
from ringmaster.workers.strategies.param_groups import GroupRule, param_groups

if TYPE_CHECKING:
    from ringmaster.workers.strategies.pipeline import TiedAcrossStages


# A parameter group's learning rate as a multiple of the schedule's (train.optimizer.groups[].lr_scale).
LR_SCALE = "lr_scale"


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer's settings (JobSpec train.optimizer); the strategy decides how it is built (ZeRO-1 shards it)."""

    lr: float
    weight_decay: float
    name: str = "adamw"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    no_decay_auto: bool = False
    groups: tuple[GroupRule, ...] = ()

    @property
    def optimizer_class(self) -> type[Optimizer]:
        return {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[self.name]

    @property
    def options(self) -> dict[str, Any]:
        """Keyword arguments of optimizer_class besides the parameters."""
        if self.name == "sgd":
            return {"lr": self.lr, "weight_decay": self.weight_decay}
        return {"lr": self.lr, "weight_decay": self.weight_decay, "betas": self.betas, "eps": self.eps}

    def groups_of(self, model: nn.Module) -> list[dict[str, Any]]:
        """model's parameters in the groups train.optimizer asks for (param_groups.py), each with its weight decay."""
        return param_groups(model, self.weight_decay, LR_SCALE, self.no_decay_auto, self.groups)

    def build(self, model: nn.Module) -> Optimizer:
        return self.optimizer_class(self.groups_of(model), **self.options)


@dataclass(frozen=True)
class ParallelSetup:
    """Everything a strategy composes from: the job, its dimensions, the world's one mesh, the device."""

    spec: JobSpec
    dims: ParallelDims
    mesh: DeviceMesh
    device: torch.device
    optimizer: OptimizerConfig

    @property
    def bf16(self) -> bool:
        return self.spec.train.precision == "bf16"


@dataclass
class ParallelModel:
    """What a strategy hands the loop: the modules this rank holds (named with the unsplit model's
    FQNs, one optimizer each) and how a micro-step runs on them."""

    parts: list[nn.Module]
    optimizers: list[Optimizer]
    # Whether this rank's losses count (once) in the global mean: last pipeline stage, first tp rank.
    holds_loss: bool
    # Backward inside this context only accumulates gradients locally (no data-parallel sync).
    accumulate_locally: Callable[[], AbstractContextManager[Any]] = nullcontext
    # Pipeline only: the schedule that runs forward and backward over micro-batches, and this rank's stages.
    schedule: PipelineScheduleSingle | PipelineScheduleMulti | None = None
    stages: list[PipelineStage] = field(default_factory=list)
    # Pipeline only: parameters the unsplit model shares between stages (tied embeddings), a copy on each holder.
    tied: list[TiedAcrossStages] = field(default_factory=list)
    # Every rank holds the whole model and optimizer state, and the optimizer step runs no collective (ddp): a rank's
    # live state is a copy of every peer's, which in-memory snapshots need not copy again (LiveStateSnapshots).
    state_replicated: bool = False
    # What the composition decided (decisions.py): blocks, FSDP units, pipeline stages, the tp plan's source, ...
    decisions: dict[str, Any] = field(default_factory=dict)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2, tensor parallel), or the tensor itself: its storage, outside autograd.
    Every caller inspects or copies state; under grad mode DTensor.to_local builds an autograd node instead, a few
    microseconds per tensor where in-memory snapshots check the whole state's structure every step."""
    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()
