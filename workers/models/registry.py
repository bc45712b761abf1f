"""The model plug-in contract: every model, built-in or user's, is a builder returning a ModelBundle.

``spec.model`` is a built-in name or ``package.module:function``; the function is called with
``spec.model_options`` as keyword arguments. Built-ins go through exactly the same path. A builder may return its
model alone where the job's data is token windows (a data source, or the pysource corpus): it then trains on the
next-token loss of the logits it returns.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import Dataset

from ringmaster.service.catalogue import BUILTIN_MODELS, HF_PREFIX, USER_DATA
from ringmaster.service.spec import DataSourceSpec, JobSpec
from ringmaster.workers.data.pysource import pysource_splits
from ringmaster.workers.data.sources import data_source_splits
from ringmaster.workers.data.synthetic import synthetic_regression_splits
from ringmaster.workers.job_input import JobInputError, defined_at

# A loss alone, or (loss, {name: metric}) with the user's own metrics, each a number or a one-element tensor.
LossOutput = torch.Tensor | tuple[torch.Tensor, dict[str, Any]]
LossFn = Callable[[nn.Module, Any], LossOutput]
TensorParallelPlan = Callable[[nn.Module, DeviceMesh], None]
PipelineStageFn = Callable[[nn.Module, int, int], nn.Module]
OutputLossFn = Callable[[torch.Tensor, Any], LossOutput]

# A user model may train on a built-in corpus (spec.data, one of the catalogue's); built from the model_options it
# names.
BUILTIN_CORPORA: dict[str, Callable[..., tuple[Dataset[Any], Dataset[Any]]]] = {
    "pysource": pysource_splits,
    "synthetic": synthetic_regression_splits,
}


class EntrypointError(JobInputError):
    """The job's model entrypoint cannot be imported, called, or returned the wrong thing."""


@dataclass
class ModelBundle:
    """What a model builder hands the trainer. ``loss_fn(model, batch)`` returns the batch's mean loss, or
    ``(loss, {name: value})`` with metrics of the user's own (each the batch's mean, a number or a one-element tensor),
    which every step reports as its mean as it does the loss; datasets are map-style so samples have stable ids.
    ``val_dataset`` may be None (no validation); ``train_dataset`` may be None only when ``spec.data`` names a built-in
    corpus or a data source.

    Optional parallelism hooks, plain functions beside the model (tiny_gpt_parallelize.py has the built-in's):
    ``tensor_parallel(model, tp_mesh)`` shards the model in place over the tensor-parallel mesh (e.g. with
    ``parallelize_module``); strategies tensor and 3d with tp > 1 need it.
    ``pipeline_stage(model, stage_index, num_stages)`` returns a new module holding only that stage's
    contiguous part of ``model`` under the unsplit model's parameter names (so checkpoints reshard), and
    ``output_loss_fn(outputs, targets)`` is the mean loss of the last stage's outputs (alone or with metrics, as
    loss_fn's); strategies pipeline and 3d with pp > 1 need both, and there a batch must be ``(inputs, targets)`` split
    along dim 0. Without them, output_loss_fn is the logits' next-token loss where loss_fn is next_token_loss, and a
    model whose forward is the chain embeddings → blocks → norm → head is split at its blocks (chain_stages.py)."""

    model: nn.Module
    train_dataset: Dataset[Any] | None
    val_dataset: Dataset[Any] | None
    loss_fn: LossFn
    tensor_parallel: TensorParallelPlan | None = None
    pipeline_stage: PipelineStageFn | None = None
    output_loss_fn: OutputLossFn | None = None


def build_bundle(spec: JobSpec) -> ModelBundle:
    """Resolve ``spec.model``, call its builder with ``spec.model_options``, and check the result."""
    model = spec.model_name
    builtin = BUILTIN_MODELS.get(model)
    entrypoint = builtin.entrypoint if builtin else model
    builder: Callable[..., Any]
    if model.startswith(HF_PREFIX):
        from ringmaster.workers.models import hf

        builder = partial(hf.build, model.removeprefix(HF_PREFIX), corpus=not isinstance(spec.data, DataSourceSpec))
    else:
        builder = resolve_entrypoint(entrypoint)
    where = defined_at(builder)  # in the job's own code: where its author looks when an error names it
    named = f"{entrypoint!r} (defined at {where})" if where else repr(entrypoint)
    try:
        inspect.signature(builder).bind(**spec.model_options)
    except TypeError as error:
        raise EntrypointError(
            f"model {named} does not accept model_options {sorted(spec.model_options)}: {error}"
        ) from None
    # Where the data is not token windows, it is a corpus's name or 'user' (JobSpec always sets it).
    token_windows = isinstance(spec.data, DataSourceSpec) or spec.data == "pysource"
    bundle = _as_bundle(builder(**spec.model_options), named, None if token_windows else cast(str, spec.data))
    _with_hf_hooks(bundle)
    if bundle.output_loss_fn is None and bundle.loss_fn is next_token_loss:
        bundle.output_loss_fn = logits_loss  # a pipeline's last stage: the same loss of the logits it outputs
    config = getattr(bundle.model, "config", None)  # a transformers model's
    if isinstance(spec.data, DataSourceSpec):
        vocab_size: int | None
        if builtin and builtin.vocab_option:
            # A size option, which JobSpec's schema makes an integer.
            vocab_size = cast(int, builtin.option(builtin.vocab_option, spec.model_options))
        else:
            vocab_size = getattr(config, "vocab_size", None)
        context = getattr(config, "max_position_embeddings", None)
        if isinstance(context, int) and spec.data.seq_len is not None and spec.data.seq_len > context:
            raise EntrypointError(
                f"data.seq_len ({spec.data.seq_len}) exceeds the context length of model "
                f"{entrypoint!r}: its config's max_position_embeddings is {context}"
            )
        bundle.train_dataset, bundle.val_dataset = data_source_splits(spec.data, vocab_size)
    elif spec.data != USER_DATA and builtin is None:
        corpus = BUILTIN_CORPORA[cast(str, spec.data)]  # JobSpec names a corpus where it names no data source
        accepted = inspect.signature(corpus).parameters
        bundle.train_dataset, bundle.val_dataset = corpus(
            **{k: v for k, v in spec.model_options.items() if k in accepted}
        )
    if bundle.train_dataset is None:
        raise EntrypointError(
            f"model {entrypoint!r} returned no train_dataset and spec.data is {spec.data!r}, not a built-in "
            "corpus or a data source"
        )
    return bundle


def resolve_entrypoint(entrypoint: str) -> Callable[..., Any]:
    """Import ``package.module:function`` and return the function."""
    module_name, _, attribute = entrypoint.partition(":")
    _job_code_first()
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        top_level = module_name.split(".")[0]
        missing_itself = isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == top_level
        hint = (
            "; ship its directory with the job (ringmaster submit --code DIR) or put it on RINGMASTER_CODE_PATH"
            if missing_itself
            else ""
        )
        raise EntrypointError(
            f"model entrypoint {entrypoint!r}: cannot import module {module_name!r}: "
            f"{type(error).__name__}: {error}{_where_raised(error)}{hint}"
        ) from error
    builder: object = getattr(module, attribute, None)
    if builder is None:
        raise EntrypointError(f"model entrypoint {entrypoint!r}: module {module_name!r} has no attribute {attribute!r}")
    if not callable(builder):
        raise EntrypointError(
            f"model entrypoint {entrypoint!r}: {attribute!r} is a {type(builder).__name__}, not a function"
        )
    return builder


def _where_raised(error: BaseException) -> str:
    """Where in the job's own code an import failed (its last frame outside the import machinery), as ' (at
    FILE:LINE)'; '' when the module itself was not found."""
    # The first frame is the import_module call here.
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)[1:] if "importlib" not in frame.filename]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _job_code_first() -> None:
    """Put the job's code path (its PYTHONPATH: the job's own code, which Ray unpacked as its working_dir, then the
    spec's runtime_env PYTHONPATH and RINGMASTER_CODE_PATH, in that order) first on sys.path. Ray puts the directory the
    job's driver (or, for a warm pool worker, the control plane) started in before it; when that is a ringmaster
    checkout, its api/, service/ and workers/ folders would shadow a user's own packages of those names. ringmaster
    itself imports only ringmaster.*, so nothing of its own can be shadowed in turn."""
    for entry in reversed(
        [os.path.abspath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    ):
        sys.path[:] = [entry] + [path for path in sys.path if os.path.abspath(path or ".") != entry]
    importlib.invalidate_caches()


def _with_hf_hooks(bundle: ModelBundle) -> None:
    """A transformers model a user's function returns gets the hooks transformers makes possible wherever the user
    supplied none: its config's tensor-parallel plan, pipeline stages cut at its blocks, the logits' loss; and no
    generation cache."""
    if "transformers" not in sys.modules:
        return
    from ringmaster.workers.models import hf

    if hf.is_hf_model(bundle.model):
        hf.without_generation_cache(bundle.model)
        bundle.tensor_parallel = bundle.tensor_parallel or hf.config_tensor_parallel
        bundle.pipeline_stage = bundle.pipeline_stage or hf.pipeline_stage
        bundle.output_loss_fn = bundle.output_loss_fn or logits_loss


def _as_bundle(result: Any, entrypoint: str, data_needing_a_bundle: str | None) -> ModelBundle:
    """Accept a ModelBundle, a tuple (model, train_dataset, loss_fn[, val_dataset]), or a model alone unless
    `data_needing_a_bundle` names the job's data (one a model alone cannot train on: not token windows). `entrypoint`:
    the entrypoint as the messages name it, with where the job's code defines it."""
    if isinstance(result, nn.Module):
        if data_needing_a_bundle is not None:
            raise EntrypointError(
                f"model entrypoint {entrypoint} returned a {type(result).__name__} alone, and with data "
                f"{data_needing_a_bundle!r} it must also return its datasets and loss: a ModelBundle or a tuple "
                "(model, train_dataset, loss_fn[, val_dataset]). A model alone trains on token windows with the "
                "next-token loss of its logits: name a data source (data: {kind: tokens | hf_dataset, ...}) or data: "
                "pysource"
            )
        result = ModelBundle(result, None, None, next_token_loss)
    if isinstance(result, tuple) and len(result) in (3, 4):
        model, train_dataset, loss_fn, *rest = result
        result = ModelBundle(model, train_dataset, rest[0] if rest else None, loss_fn)
    if not isinstance(result, ModelBundle):
        raise EntrypointError(
            f"model entrypoint {entrypoint} returned {type(result).__name__}; expected a ModelBundle, "
            "a tuple (model, train_dataset, loss_fn[, val_dataset]), or a torch.nn.Module alone (on token windows)"
        )
    if not isinstance(result.model, nn.Module):
        raise EntrypointError(
            f"model entrypoint {entrypoint}: model is a {type(result.model).__name__}, not a torch.nn.Module"
        )
    if not callable(result.loss_fn):
        raise EntrypointError(
            f"model entrypoint {entrypoint}: loss_fn is a {type(result.loss_fn).__name__}, not callable"
        )
    return result


def next_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss of a model given alone, and of every transformers causal LM: the mean cross-entropy of the logits it
    returns (see model_logits) against the window's next tokens."""
    inputs, targets = batch
    return logits_loss(model_logits(model(inputs)), targets)


def logits_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 3 or logits.shape[:2] != targets.shape:
        raise EntrypointError(
            f"the model's forward returned logits of shape {tuple(logits.shape)} for a window of shape "
            f"{tuple(targets.shape)}: the next-token loss needs (batch, positions, vocabulary), every position's "
            "logits (a model that returns the last position's alone when called without targets must return all)"
        )
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def model_logits(output: Any) -> torch.Tensor:
    """The logits in what a model's forward returned: the tensor itself; an output with `.logits` (transformers', a
    dataclass); a mapping with "logits"; or a tuple or list whose first item is a tensor, as `(logits, loss)` in common
    GPT training code (its loss, if any, is left aside: the window's targets are not passed to forward). Anything else
    fails the job in one line that says what to return."""
    if isinstance(output, torch.Tensor):
        return output
    found = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if found is None and isinstance(output, tuple | list) and output:
        found = output[0]
    if isinstance(found, torch.Tensor):
        return found
    raise EntrypointError(
        f"the model's forward returned {_described(output)}, in which the next-token loss finds no logits: return the "
        "logits tensor, a tuple whose first item is it (logits, loss), or an object or dict with `logits`; or give "
        "the model a loss_fn of its own"
    )


def _described(output: Any) -> str:
    if isinstance(output, tuple | list):
        return f"a {type(output).__name__} of ({', '.join(type(item).__name__ for item in output)})"
    return f"a {type(output).__name__}"
