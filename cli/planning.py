"""`ringmaster plan`: which parallelism fits a model on a cluster, asked of the API's planner (POST /v1/plan)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
import yaml

from ringmaster.cli.failures import _describe, _fail, _handled
from ringmaster.cli.jobs import ApiOption, _client
from ringmaster.cli.render import _print_plan
from ringmaster.service.client import ApiError

_COUNT_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def _count(text: str) -> int:
    """A parameter count written the way people say it: 7B, 350M, 1.5T, 13e9 or 7000000000."""
    cleaned = text.strip().replace("_", "").replace(",", "")
    scale = _COUNT_SUFFIXES.get(cleaned[-1:].lower(), 1)
    try:
        value = float(cleaned[:-1] if scale > 1 else cleaned) * scale
    except ValueError:
        raise typer.BadParameter(f"not a parameter count: {text!r} (try 7B, 350M or 13e9)") from None
    if value < 1 or value != int(value):
        raise typer.BadParameter(f"a parameter count is a whole number ≥ 1, got {text!r}")
    return int(value)


def _model_options(pairs: list[str]) -> dict[str, Any]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"model options are key=value, got {pair!r}")
        options[key] = yaml.safe_load(value)
    return options


@_handled
def plan(
    gpu_memory_gb: Annotated[float, typer.Option("--gpu-memory-gb", help="Memory of each GPU, GB (10⁹ bytes).")],
    parameters: Annotated[
        str | None, typer.Option("--parameters", "-p", help="Parameter count: 7B, 350M, 13e9.")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="A built-in (tiny-gpt, mlp) sized from its options, instead of --parameters.")
    ] = None,
    option: Annotated[
        list[str] | None, typer.Option("--option", "-o", help="The built-in's option key=value; repeatable.")
    ] = None,
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node; tensor parallelism stays inside one.")] = 8,
    nodes: Annotated[int, typer.Option(help="Nodes.")] = 1,
    precision: Annotated[
        str, typer.Option(help="mixed (2+2+4+8, the seeds'), bf16 (ringmaster's autocast, 4+4+8) or fp32.")
    ] = "mixed",
    micro_batch_size: Annotated[
        int | None, typer.Option(help="Sequences per micro-batch: with the shape, activations and TP/PP traffic.")
    ] = None,
    layers: Annotated[int | None, typer.Option(help="Transformer blocks (with --parameters).")] = None,
    hidden: Annotated[int | None, typer.Option(help="Hidden size (with --parameters).")] = None,
    heads: Annotated[int | None, typer.Option(help="Attention heads (with --parameters).")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Sequence length (with --parameters).")] = None,
    microbatches: Annotated[int, typer.Option(help="Pipeline micro-batches per step.")] = 8,
    schedule: Annotated[str, typer.Option(help="gpipe, 1f1b or interleaved1f1b.")] = "1f1b",
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of a table.")] = False,
    api: ApiOption = None,
) -> None:
    """Which parallelism fits a model on a cluster: memory per GPU, traffic per step, bubble, and the pick."""
    request: dict[str, Any] = {
        "parameters": _count(parameters) if parameters is not None else None,
        "model": model,
        "model_options": _model_options(option or []),
        "gpu_memory_gb": gpu_memory_gb,
        "gpus_per_node": gpus_per_node,
        "nodes": nodes,
        "precision": precision,
        "micro_batch_size": micro_batch_size,
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "seq_len": seq_len,
        "microbatches": microbatches,
        "schedule": schedule,
    }
    try:
        result = _client(api).plan(request)
    except ApiError as error:
        _fail(_describe(error, "plan request"))
    if as_json:
        print(json.dumps(result, indent=2))
        return
    _print_plan(result)
