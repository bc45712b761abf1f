"""Pipeline stages for a plain model without a pipeline_stage hook, whose forward is the common chain
``embeddings → blocks → norm → head``: the first stage runs the model's own forward up to its first block (so any
embedding code, positions included, is the model's), every stage runs its contiguous blocks one after another, and the
last runs the modules registered after the blocks' container in order. A micro-batch through the chain must give the
model's own output at build time, or the job fails asking for a hook."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.models.registry import ModelBundle, PipelineStageFn, model_logits
from ringmaster.workers.strategies.blocks import block_container, named_model, repeated_blocks


class _ReachedBlocks(Exception):
    """Ends the model's own forward at its first block, carrying the hidden states it was about to take."""

    def __init__(self, hidden_states: torch.Tensor) -> None:
        super().__init__()
        self.hidden_states = hidden_states


class _ChainForward:
    """A stage's forward, set on the stage's copy of the model so parameter names stay the unsplit model's. Modules
    are looked up by name at every call, so the wrappers strategies put around blocks (checkpointing, compile) run."""

    def __init__(self, stage: nn.Module, container: str, after: list[str], first: bool, last: bool) -> None:
        self._model_forward: Callable[..., Any] = stage.forward
        self._stage, self._container, self._after, self._first, self._last = stage, container, after, first, last

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        blocks = list(self._stage.get_submodule(self._container).children())
        hidden = _embedded(self._model_forward, blocks[0], inputs) if self._first else inputs
        for block in blocks:
            hidden = block(hidden)
        for name in self._after if self._last else ():
            hidden = self._stage.get_submodule(name)(hidden)
        return hidden


def chain_pipeline_stage(bundle: ModelBundle, num_stages: int) -> PipelineStageFn:
    """The split, after checking on one training sample that the chain gives the model's own output; a one-line
    JobInputError naming the model where it cannot."""
    model = bundle.model
    blocks = repeated_blocks(model)
    found = block_container(model, blocks)
    if found is None:
        raise _needs_hook(model, "it has no ModuleList or ModuleDict of repeated blocks")
    container, _ = found
    if len(blocks) < num_stages:
        raise _needs_hook(model, f"its {len(blocks)} blocks at {container} cannot fill {num_stages} pipeline stages")
    before, after = _around(model, container)
    _check_chain(model, bundle, container, after)

    def pipeline_stage(unsplit: nn.Module, stage_index: int, stages: int) -> nn.Module:
        stage = copy.deepcopy(unsplit)
        holder = stage.get_submodule(container)
        keys = list(holder._modules)
        start, stop = len(keys) * stage_index // stages, len(keys) * (stage_index + 1) // stages
        for key in keys[:start] + keys[stop:]:
            del holder._modules[key]  # the kept blocks keep their names ("transformer.h.3")
        first, last = stage_index == 0, stage_index == stages - 1
        for name in (before if not first else []) + (after if not last else []):
            parent, _, child = name.rpartition(".")
            del stage.get_submodule(parent)._modules[child]
        stage.forward = _ChainForward(stage, container, after, first, last)
        return stage

    return pipeline_stage


def _embedded(model_forward: Callable[..., Any], first_block: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The hidden states the model's own forward hands its first block."""

    def stop(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            raise _BlocksTakeMore()
        raise _ReachedBlocks(args[0])

    # First, ahead of any FSDP unshard hook: the block runs afterwards, called by the stage itself.
    handle = first_block.register_forward_pre_hook(stop, prepend=True, with_kwargs=True)
    try:
        model_forward(inputs)
    except _ReachedBlocks as reached:
        return reached.hidden_states
    finally:
        handle.remove()
    raise _NeverReachedBlocks()


class _BlocksTakeMore(Exception):
    """The model calls its blocks with more than the hidden states."""


class _NeverReachedBlocks(Exception):
    """The model's forward returned without calling its first block."""


def _around(model: nn.Module, container: str) -> tuple[list[str], list[str]]:
    """The modules registered before and after the blocks' container, siblings of it or of an enclosing module, each
    in forward order (innermost first for those after); parameters held by the enclosing modules themselves are not
    part of the chain."""
    before: list[str] = []
    after: list[str] = []
    path = container.split(".")
    for depth in range(len(path), 0, -1):
        parent_name = ".".join(path[: depth - 1])
        parent = model.get_submodule(parent_name)
        if any(True for _ in parent.parameters(recurse=False)):
            raise _needs_hook(model, f"{parent_name or 'the model itself'} holds parameters outside its submodules")
        children = [name for name, module in parent._modules.items() if module is not None]
        position = children.index(path[depth - 1])
        prefix = f"{parent_name}." if parent_name else ""
        before = [prefix + name for name in children[:position]] + before
        after += [prefix + name for name in children[position + 1 :]]
    return before, after


def _check_chain(model: nn.Module, bundle: ModelBundle, container: str, after: list[str]) -> None:
    """Run one training sample through the chain on the whole model and compare with its own forward (in eval mode:
    dropout off); until the forward reaches the first block it must use no module registered after the blocks'
    container, nor another block, since the first stage holds none of them."""
    if bundle.train_dataset is None:
        raise _needs_hook(model, "there is no training sample to check the split on")
    device = next(model.parameters()).device
    inputs = default_collate([bundle.train_dataset[0]])[0].to(device)
    blocks = list(model.get_submodule(container).children())
    ends = [model.get_submodule(name) for name in after]
    used_later: list[nn.Module] = []
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = model_logits(model(inputs))
            handles = [
                module.register_forward_pre_hook(lambda module, args: used_later.append(module))
                for module in ends + blocks[1:]
            ]
            try:
                hidden = _embedded(model.forward, blocks[0], inputs)
            finally:
                for handle in handles:
                    handle.remove()
            for module in blocks + ends:
                hidden = module(hidden)
    except _BlocksTakeMore:
        raise _needs_hook(model, "its forward calls its blocks with more than the hidden states") from None
    except _NeverReachedBlocks:
        raise _needs_hook(model, "its forward does not call its first block") from None
    finally:
        model.train(training)
    if used_later:
        raise _needs_hook(model, "its forward uses modules registered after its first block before reaching it")
    if hidden.shape != expected.shape or not torch.allclose(hidden, expected, rtol=1e-5, atol=1e-6):
        raise _needs_hook(
            model, "its modules run as the chain embeddings → blocks → the modules after them do not give its output"
        )


def _needs_hook(model: nn.Module, reason: str) -> JobInputError:
    return JobInputError(
        f"model {named_model(model)} cannot be split into pipeline stages automatically: {reason}; give "
        "ModelBundle.pipeline_stage (and output_loss_fn)"
    )
