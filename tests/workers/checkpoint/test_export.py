"""A job's checkpoint exported as model.safetensors (+ an hf: model's config.json): the trained weights, whole, whatever
strategy sharded them, loadable by transformers' from_pretrained and by another job's model_options.pretrained; a
checkpoint that does not verify, or an occupied output directory, is refused with nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.checkpoints import latest_committed, load_model_weights
from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec
from ringmaster.workers.checkpoint.export import CONFIG_NAME, WEIGHTS_NAME, ExportError, export_checkpoint
from ringmaster.workers.models import build_bundle
from ringmaster.workers.trainer import TrainContext, run_training
from tests.workers.models.test_hf import hf_spec

# A tied GPT-2 sharded by FSDP, and a Llama split by tensor parallelism (DTensor shards of every block).
CASES = {"gpt2-fsdp-zero3": ("gpt2", "fsdp-zero3"), "llama-tensor": ("llama", "tensor")}


def _spec(case: str) -> JobSpec:
    return JobSpec.model_validate(hf_spec(*CASES[case]))


def _train_every_case(rank: int, world_size: int, root: str) -> None:
    for case in CASES:
        run_training(
            _spec(case),
            TrainContext(rank, world_size, torch.device("cpu"), case, f"{root}/{case}", sink=CallbackSink()),
        )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export")
    run_on_ranks(_train_every_case, 2, str(root))
    return root


def _model_class_and_options(case: str) -> tuple[str, dict]:
    spec = _spec(case)
    return spec.model.removeprefix("hf:"), dict(spec.model_options)


@pytest.mark.parametrize("case", list(CASES))
def test_a_sharded_checkpoint_exports_the_trained_weights_whole_for_from_pretrained(
    trained: Path, tmp_path: Path, case: str
) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint = latest_committed(trained / case)
    model_class, options = _model_class_and_options(case)
    exported = export_checkpoint(checkpoint.path, tmp_path / "out", model_class, options)
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME])

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == model_class
    # The reference: an unsharded model of the job's own build, given the checkpoint's weights by DCP itself.
    torch.manual_seed(_spec(case).train.seed)
    reference = build_bundle(_spec(case)).model
    initial = {name: tensor.clone() for name, tensor in reference.state_dict().items()}
    load_model_weights(checkpoint.path, reference)
    expected = reference.state_dict()
    assert set(loaded.state_dict()) == set(expected)
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    assert any(not torch.equal(expected[name], initial[name]) for name in expected), "training moved no weight"
    assert exported.tensors == len(load_file(exported.weights))
    if case.startswith("gpt2"):  # tied: one parameter under both names, as the job trained it
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_an_export_starts_another_job_as_its_pretrained_weights(trained: Path, tmp_path: Path) -> None:
    checkpoint = latest_committed(trained / "gpt2-fsdp-zero3")
    model_class, options = _model_class_and_options("gpt2-fsdp-zero3")
    export_checkpoint(checkpoint.path, tmp_path / "out", model_class, options)
    exported = load_file(tmp_path / "out" / WEIGHTS_NAME)
    spec = hf_spec("gpt2", "ddp")
    spec["model_options"] = {**spec["model_options"], "pretrained": str(tmp_path / "out")}
    started = build_bundle(JobSpec.model_validate(spec)).model.state_dict()
    for name, tensor in exported.items():
        torch.testing.assert_close(started[name], tensor, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_an_occupied_directory_or_a_checkpoint_that_fails_its_manifest_is_refused_with_nothing_written(
    trained: Path, tmp_path: Path
) -> None:
    checkpoint = latest_committed(trained / "llama-tensor")
    model_class, options = _model_class_and_options("llama-tensor")
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists and is not an empty directory"):
        export_checkpoint(checkpoint.path, occupied, model_class, options)
    assert [path.name for path in occupied.iterdir()] == ["notes.txt"]

    with pytest.raises(ExportError, match=r"is not a committed checkpoint: it has no readable manifest.json"):
        export_checkpoint(str(tmp_path), tmp_path / "out-nothing", model_class, options)
    assert not (tmp_path / "out-nothing").exists()

    # A shard file cut short (in a copy: the other tests read the original): the manifest's sizes catch it before
    # anything is read or written.
    copy = shutil.copytree(checkpoint.path, tmp_path / Path(checkpoint.path).name)
    shard = next(copy.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(
        ExportError, match=rf"does not match its manifest: .*{shard.name}: \d+ bytes, manifest says \d+"
    ):
        export_checkpoint(str(copy), tmp_path / "out-corrupt", model_class, options)
    assert not (tmp_path / "out-corrupt").exists()
