"""Hugging Face transformers models (GPT-2 with its tied embeddings, Llama with its config's tensor-parallel plan) as
users write them: built from a config with random weights, given as `hf:<class>` or returned by a user's function.
Every strategy follows ddp's losses; FSDP shards per block wherever the blocks sit; weights come from safetensors;
what cannot work is refused at submit with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch.distributed.fsdp import FSDPModule

from harness.checkpoints import latest_committed, load_model_weights
from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec
from ringmaster.workers.models import build_bundle
from ringmaster.workers.parallel_dims import ParallelDims
from ringmaster.workers.strategies import OptimizerConfig, ParallelSetup, parallelize
from ringmaster.workers.strategies.blocks import repeated_blocks
from ringmaster.workers.trainer import TrainContext, run_training

# No dropout, so every layout computes the same function.
GPT2 = {
    "vocab_size": 256,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 32,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "seq_len": 32,
    "max_corpus_bytes": 32_768,
}
LLAMA = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "seq_len": 32,
    "max_corpus_bytes": 32_768,
}
MODELS = {"gpt2": ("hf:GPT2LMHeadModel", GPT2), "llama": ("hf:LlamaForCausalLM", LLAMA)}
STEPS = 3
# name: strategy, parallel, micro_batch_size, ranks per node (hybrid replicates across two one-rank "nodes")
STRATEGIES = {
    "ddp": ("ddp", {}, 4, None),
    "zero1": ("zero1", {}, 4, None),
    "fsdp-zero2": ("fsdp", {"shard": "zero2"}, 4, None),
    "fsdp-zero3": ("fsdp", {"shard": "zero3"}, 4, None),
    "fsdp-hybrid": ("fsdp", {"shard": "hybrid"}, 4, (1, 1)),
    "tensor": ("tensor", {"tp": 2}, 8, None),
    "pipeline-1f1b": ("pipeline", {"pp": 2, "microbatches": 4}, 2, None),
}


def hf_spec(model: str, strategy: str, workers: int = 2, steps: int = STEPS, **overrides) -> dict:
    name, options = MODELS[model]
    kind, parallel, micro_batch_size, _ = STRATEGIES[strategy]
    return {
        "name": f"hf-{model}-{strategy}",
        "model": name,
        "model_options": options,
        "strategy": kind,
        "parallel": parallel,
        "workers": {"min": workers, "max": workers},
        "train": {
            "steps": steps,
            "global_batch_size": 16,
            "micro_batch_size": micro_batch_size,
            "lr": 3e-3,
            "seed": 1,
            "grad_clip": 1.0,
        },
        **overrides,
    }


def _cases() -> list[tuple[str, str]]:
    return [
        (model, strategy)
        for model in MODELS
        for strategy in STRATEGIES
        if not (model == "gpt2" and strategy == "tensor")
    ]  # GPT-2 ships no tensor-parallel plan


def _train_every_case(rank: int, world_size: int, root: str) -> None:
    for model, strategy in _cases():
        points: list = []
        run_training(
            JobSpec.model_validate(hf_spec(model, strategy)),
            TrainContext(
                rank,
                world_size,
                torch.device("cpu"),
                "hf",
                f"{root}/{model}-{strategy}",
                sink=CallbackSink(on_metric=points.append),
                ranks_per_node=STRATEGIES[strategy][3],
            ),
        )
        if rank == 0:
            Path(root, f"{model}-{strategy}.json").write_text(
                json.dumps([(point.loss, point.grad_norm) for point in points if point.loss is not None])
            )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    run_on_ranks(_train_every_case, 2, str(root))
    return root


@pytest.mark.parametrize("model,strategy", [case for case in _cases() if case[1] != "ddp"])
def test_every_strategy_follows_ddp(trained: Path, model: str, strategy: str) -> None:
    ddp = json.loads((trained / f"{model}-ddp.json").read_text())
    other = json.loads((trained / f"{model}-{strategy}.json").read_text())
    assert len(other) == STEPS
    assert [loss for loss, _ in other] == pytest.approx([loss for loss, _ in ddp], abs=1e-5)
    assert [norm for _, norm in other] == pytest.approx([norm for _, norm in ddp], rel=1e-5)


@pytest.mark.parametrize("strategy", ["fsdp-zero3", "pipeline-1f1b"])
def test_tied_embeddings_stay_tied_in_the_checkpoint(trained: Path, strategy: str) -> None:
    """Under the pipeline the first stage trains wte and the last lm_head: the checkpoint holds both, equal."""
    model = build_bundle(JobSpec.model_validate(hf_spec("gpt2", strategy))).model
    untouched = model.lm_head.weight.detach().clone()
    checkpoint = latest_committed(trained / f"gpt2-{strategy}").path
    load_model_weights(checkpoint, model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not torch.equal(model.lm_head.weight, untouched)  # the trained weights were loaded
    untied = build_bundle(
        JobSpec.model_validate(hf_spec("gpt2", strategy, model_options={**GPT2, "tie_word_embeddings": False}))
    ).model
    load_model_weights(checkpoint, untied)  # loads each name on its own: the two saved copies are equal
    torch.testing.assert_close(untied.lm_head.weight, untied.transformer.wte.weight, rtol=0, atol=0)


def test_pipeline_stages_keep_the_unsplit_names() -> None:
    from ringmaster.workers.models.hf import pipeline_stage

    for model in MODELS:
        whole = build_bundle(JobSpec.model_validate(hf_spec(model, "ddp", workers=1))).model
        names = set(whole.state_dict())
        stages = [set(pipeline_stage(whole, index, 2).state_dict()) for index in range(2)]
        assert stages[0] | stages[1] == names and all(stage < names for stage in stages), model


def test_fsdp_units_are_the_blocks_inside_the_model(single_rank_group: None) -> None:
    for model in MODELS:
        spec = JobSpec.model_validate(hf_spec(model, "fsdp-zero3", workers=1))
        bundle = build_bundle(spec)
        blocks = repeated_blocks(bundle.model)
        assert [type(block).__name__ for block in blocks] == [next(iter(bundle.model._no_split_modules))] * 2
        dims = ParallelDims.from_spec(spec, 1, None)
        parallelize(
            bundle, ParallelSetup(spec, dims, dims.build_mesh("cpu"), torch.device("cpu"), OptimizerConfig(1e-3, 0.0))
        )
        assert all(isinstance(block, FSDPModule) for block in blocks)


def test_pretrained_safetensors_are_the_starting_weights(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    source = build_bundle(JobSpec.model_validate(hf_spec("llama", "ddp", workers=1))).model
    torch.manual_seed(123)
    for parameter in source.parameters():
        parameter.data.normal_()
    save_file({key: value.contiguous() for key, value in source.state_dict().items()}, tmp_path / "model.safetensors")
    for location in (str(tmp_path), str(tmp_path / "model.safetensors"), f"file://{tmp_path}/model.safetensors"):
        spec = hf_spec("llama", "ddp", workers=1)
        spec["model_options"] = {**spec["model_options"], "pretrained": location}
        loaded = build_bundle(JobSpec.model_validate(spec)).model
        for key, value in source.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value), (location, key)
    spec["model_options"] = {**LLAMA, "num_hidden_layers": 3, "pretrained": str(tmp_path)}
    with pytest.raises(ValueError, match=r"does not fit the model: missing \['model.layers.2"):
        build_bundle(JobSpec.model_validate(spec))


def test_what_cannot_work_is_refused_at_submit_with_the_reason() -> None:
    with pytest.raises(ValidationError, match="transformers has no model class 'NoSuchForCausalLM'"):
        JobSpec.model_validate({**hf_spec("llama", "ddp"), "model": "hf:NoSuchForCausalLM"})
    with pytest.raises(
        ValidationError, match=r"no tensor-parallel plan for GPT2LMHeadModel .GPT2Config has no base_model_tp_plan"
    ):
        JobSpec.model_validate(
            {
                **hf_spec("gpt2", "ddp"),
                "strategy": "tensor",
                "parallel": {"tp": 2},
                "train": {**hf_spec("gpt2", "ddp")["train"], "micro_batch_size": 8},
            }
        )
    JobSpec.model_validate(hf_spec("llama", "tensor"))  # Llama's config carries one


def test_unknown_config_fields_get_a_clear_error() -> None:
    spec = hf_spec("gpt2", "ddp", workers=1)
    spec["model_options"] = {**GPT2, "n_layers": 2}
    with pytest.raises(ValueError, match=r"model_options \['n_layers'\] are not fields of GPT2Config"):
        build_bundle(JobSpec.model_validate(spec))


def test_the_hugging_face_token_file_example_trains(tmp_path: Path, single_rank_group: None, monkeypatch) -> None:
    """examples/make_tokens.py writes the token file examples/hf-tokens.yaml trains on (here two steps on one rank)."""
    import subprocess
    import sys

    import yaml

    tokens = tmp_path / "text.bin"
    subprocess.run([sys.executable, "examples/make_tokens.py", "--out", str(tokens)], check=True)
    document = yaml.safe_load(Path("examples/hf-tokens.yaml").read_text())
    document["data"]["path"] = str(tokens)
    document["workers"] = {"min": 1, "max": 1}
    document["checkpoint"] = {"every_steps": 0, "keep": 1}
    document["train"] = {**document["train"], "steps": 2, "warmup_steps": 1, "eval_every_steps": 0}
    points: list = []
    result = run_training(
        JobSpec.model_validate(document),
        TrainContext(
            0, 1, torch.device("cpu"), "example", str(tmp_path / "job"), sink=CallbackSink(on_metric=points.append)
        ),
    )
    losses = [point.loss for point in points if point.loss is not None]
    assert len(losses) == 2 and result.val_loss is not None
    assert abs(losses[0] - torch.log(torch.tensor(256.0)).item()) < 0.5  # random init on bytes: about log(256)
