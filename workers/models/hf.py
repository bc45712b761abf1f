"""Hugging Face transformers causal language models as ringmaster models: ``model: hf:<ModelClass>`` builds one from
its config's fields in model_options (random weights, or model_options.pretrained's safetensors), and a user's own
function may return a transformers model just as well. What the strategies need beyond plain PyTorch is here: the
next-token loss, the tensor-parallel plan the model's config carries, and pipeline stages cut at its blocks."""

from __future__ import annotations

import copy
import fnmatch
import inspect
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import Dataset

from ringmaster.workers.data.pysource import pysource_splits
from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.models.registry import EntrypointError, ModelBundle, logits_loss, model_logits, next_token_loss
from ringmaster.workers.strategies.blocks import block_container, repeated_blocks

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

# model_options of an hf: model that are not fields of its config
PRETRAINED_OPTION = "pretrained"
DATA_OPTIONS = ("seq_len", "max_corpus_bytes")  # the built-in corpus's, when the job trains on one
_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


class _TransformersModel(Protocol):
    """What this module reads of a transformers model beyond nn.Module's own (whose __getattr__ types any other
    attribute as a tensor or a module)."""

    @property
    def base_model(self) -> nn.Module: ...

    def get_output_embeddings(self) -> nn.Module | None: ...


def build(model_class: str, corpus: bool = True, **options: Any) -> ModelBundle:
    """``hf:<model_class>``: the model from its config's fields (the other model_options), with the weights of
    ``pretrained`` (a safetensors file, or a directory holding model.safetensors, at a path or fsspec URI) when given;
    trained on the built-in byte-level corpus unless the job names a data source (``corpus`` False)."""
    pretrained = options.pop(PRETRAINED_OPTION, None)
    data_options = {name: options.pop(name) for name in DATA_OPTIONS if name in options}
    cls, config = model_class_and_config(model_class, options)
    model = cls(config)
    if pretrained is not None:
        load_safetensors(model, pretrained)
    if getattr(config, "vocab_size", 256) < 256:
        raise EntrypointError(
            f"model 'hf:{model_class}': vocab_size {config.vocab_size} cannot hold the byte-level corpus's 256 tokens"
        )
    train, validation = pysource_splits(**data_options) if corpus else (None, None)
    return hf_bundle(model, train, validation)


def model_class_and_config(
    model_class: str, config_options: dict[str, Any]
) -> tuple[type[PreTrainedModel], PreTrainedConfig]:
    """``hf:<model_class>``'s transformers class, and its config from the model_options that are config fields (those
    without ``pretrained`` and the data options)."""
    import transformers

    cls = getattr(transformers, model_class, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise EntrypointError(
            f"model 'hf:{model_class}': transformers {transformers.__version__} has no model class {model_class!r}"
        )
    # A transformers model class names its config class (the PreTrainedModel base itself names none).
    config_class = cast("type[PreTrainedConfig]", cls.config_class)
    accepted = set(inspect.signature(config_class.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(set(config_options) - accepted)
    if unknown:
        raise EntrypointError(
            f"model 'hf:{model_class}': model_options {unknown} are not fields of {config_class.__name__}"
        )
    return cls, config_class(**config_options)


def hf_bundle(model: nn.Module, train_dataset: Dataset[Any] | None, val_dataset: Dataset[Any] | None) -> ModelBundle:
    """A transformers causal LM with the hooks every strategy needs."""
    without_generation_cache(model)
    return ModelBundle(
        model,
        train_dataset,
        val_dataset,
        next_token_loss,
        tensor_parallel=config_tensor_parallel,
        pipeline_stage=pipeline_stage,
        output_loss_fn=logits_loss,
    )


def is_hf_model(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "get_input_embeddings") and hasattr(model, "_no_split_modules")


def without_generation_cache(model: nn.Module) -> None:
    """Training never reads the key/value cache a transformers model fills for generation by default: building it in
    every forward costs about 5% of a small GPT-2's step."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", None):
        config.use_cache = False


def load_safetensors(model: nn.Module, location: str) -> None:
    """Load a safetensors file (or a directory's model.safetensors) at a path or fsspec URI into ``model``; every
    parameter must be there, except a tied one whose twin is."""
    import fsspec
    from safetensors.torch import load_file

    if "://" in location:
        location = fsspec.open_local(f"simplecache::{location}")
    if os.path.isdir(location):
        location = os.path.join(location, "model.safetensors")
    if not os.path.isfile(location):
        raise EntrypointError(f"model_options.pretrained: no safetensors file at {location!r}")
    weights = load_file(location)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [key for key in missing if key not in tied]
    if missing or unexpected:
        raise EntrypointError(
            f"model_options.pretrained {location!r} does not fit the model: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )
    tie_weights = getattr(model, "tie_weights", None)
    if tie_weights is not None:
        tie_weights()


def config_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The tensor-parallel plan transformers ships in the model's config (``base_model_tp_plan``, over the base
    model's blocks), applied with torch's own ColwiseParallel/RowwiseParallel. Embeddings, norms and head stay
    replicated."""
    plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    if not plan:
        raise JobInputError(
            f"{type(model).__name__} carries no tensor-parallel plan (config.base_model_tp_plan); "
            "return a ModelBundle with a tensor_parallel hook from your own model function"
        )
    degree, config = tp_mesh.size(), model.config
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, field, None)
        if value is not None and value % degree:
            raise JobInputError(f"parallel.tp ({degree}) must divide the model's {field} ({value})")
    styles = {}
    for pattern, style in plan.items():
        if style not in _STYLES:
            raise JobInputError(
                f"{type(model).__name__}'s tensor-parallel plan uses {style!r} for {pattern!r}; "
                f"ringmaster applies {sorted(_STYLES)}"
            )
        styles[pattern] = _STYLES[style]()
    base = cast(_TransformersModel, model).base_model
    names = [name for name, _ in base.named_modules()]
    parallelize_module(
        base, tp_mesh, {name: style for pattern, style in styles.items() for name in fnmatch.filter(names, pattern)}
    )


class _PassThrough(nn.Module):
    """Stands in for another stage's block: hands the hidden states on (a block's first argument) unchanged."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


class _Zeros(nn.Module):
    """Stands in for an embedding on a later pipeline stage, where the first stage already added it."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), dtype=torch.get_default_dtype(), device=ids.device)


class _StageForward:
    """A pipeline stage's forward, set on the stage's copy of the model so parameter names stay the unsplit model's.
    The first stage takes token ids; later ones take the hidden states as inputs_embeds (their input embeddings gone,
    position embeddings adding zero); the last ends in the norm and head, the others skip them."""

    def __init__(self, forward: Callable[..., Any], first: bool) -> None:
        self._forward, self._first = forward, first

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        return model_logits(self._forward(input_ids=inputs) if self._first else self._forward(inputs_embeds=inputs))


def pipeline_stage(model: nn.Module, stage_index: int, num_stages: int) -> nn.Module:
    blocks = repeated_blocks(model)
    found = block_container(model, blocks)
    if found is None or len(blocks) < num_stages:
        raise JobInputError(f"{type(model).__name__}: {len(blocks)} blocks cannot fill {num_stages} pipeline stages")
    container_name, _ = found
    stage = copy.deepcopy(model)
    container = stage.get_submodule(container_name)
    keys = list(container._modules)
    start, stop = len(keys) * stage_index // num_stages, len(keys) * (stage_index + 1) // num_stages
    for key in keys[:start] + keys[stop:]:
        container._modules[key] = _PassThrough()  # parameter-free, and the kept blocks keep their names ("h.3")
    parent = stage.get_submodule(container_name.rpartition(".")[0]) if "." in container_name else stage
    modules = cast(dict[str, nn.Module], parent._modules)  # a transformers model registers no None child
    children = list(modules)
    position = children.index(container_name.rpartition(".")[2])
    for name in children[:position] if stage_index > 0 else ():
        if isinstance(modules[name], nn.Embedding):
            modules[name] = _Zeros()
        elif isinstance(modules[name], nn.Dropout):
            modules[name] = nn.Identity()
    last = stage_index == num_stages - 1
    for name in children[position + 1 :] if not last else ():
        if any(True for _ in modules[name].parameters()):
            modules[name] = nn.Identity()
    if not last:
        _replace(stage, cast(_TransformersModel, stage).get_output_embeddings(), nn.Identity())
    stage.forward = _StageForward(stage.forward, first=stage_index == 0)
    return stage


def _replace(root: nn.Module, target: nn.Module | None, replacement: nn.Module) -> None:
    for name, module in list(root.named_modules()):
        if module is target and name:
            parent, _, attribute = name.rpartition(".")
            setattr(root.get_submodule(parent) if parent else root, attribute, replacement)
