"""JobSpec rejects bad input with messages that name the offending field."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from ringmaster.service.spec import JobSpec, parse_spec_text


def _errors(**fields: Any) -> list[ErrorDetails]:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({"name": "job", "model": "mlp", **fields})
    return info.value.errors()


def test_workers_min_above_max_names_both_fields() -> None:
    [error] = _errors(workers={"min": 4, "max": 2})
    assert error["loc"] == ("workers",)
    assert "workers.min (4)" in error["msg"] and "workers.max (2)" in error["msg"]


def test_global_batch_not_divisible_names_the_field_and_the_world_size() -> None:
    [error] = _errors(workers={"min": 1, "max": 3}, train={"global_batch_size": 8, "micro_batch_size": 4})
    assert "train.global_batch_size (8)" in error["msg"]
    assert "4 × 3 = 12" in error["msg"]


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"optimizer": "adam"}, ("optimizer",)),
        ({"workers": {"gpus": 1}}, ("workers", "gpus")),
        ({"train": {"epochs": 2}}, ("train", "epochs")),
    ],
)
def test_unknown_field_is_rejected_at_its_path(fields: dict[str, Any], loc: tuple[str, ...]) -> None:
    [error] = _errors(**fields)
    assert (error["type"], error["loc"]) == ("extra_forbidden", loc)


def test_unknown_model_name_lists_the_choices() -> None:
    [error] = _errors(model="resnet50")
    assert error["loc"] == ("model",)
    assert "'resnet50'" in error["msg"] and "mlp, tiny-gpt" in error["msg"]


@pytest.mark.parametrize("name", ["Upper", "has space", "-leading", "trailing-", "x" * 65, ""])
def test_bad_job_name_is_rejected_on_name(name: str) -> None:
    [error] = _errors(name=name)
    assert error["loc"] == ("name",)


def test_user_entrypoint_model_is_accepted_and_defaults_to_user_data() -> None:
    spec = JobSpec(name="mine", model="my_pkg.models:build")
    assert spec.data == "user"


def test_yaml_spec_equals_the_same_spec_in_json() -> None:
    text = (
        "name: gpt\nmodel: tiny-gpt\nworkers: {min: 2, max: 4}\ntrain: {global_batch_size: 48, micro_batch_size: 4}\n"
    )
    expected = JobSpec.model_validate(
        {
            "name": "gpt",
            "model": "tiny-gpt",
            "workers": {"min": 2, "max": 4},
            "train": {"global_batch_size": 48, "micro_batch_size": 4},
        }
    )
    assert parse_spec_text(text) == expected
    assert expected.data == "pysource"


def test_yaml_that_is_not_a_mapping_is_rejected() -> None:
    with pytest.raises(ValueError, match="mapping"):
        parse_spec_text("- name: job\n")


def test_model_parallel_degrees_must_divide_every_world_size() -> None:
    [error] = _errors(
        strategy="3d",
        parallel={"tp": 2, "pp": 2},
        workers={"min": 4, "max": 6},
        train={"global_batch_size": 16, "micro_batch_size": 1},
    )
    assert "parallel.tp × parallel.pp (2 × 2 = 4); 5 is not" in error["msg"]


def test_pipeline_batch_counts_microbatches_and_data_parallel_replicas() -> None:
    spec = JobSpec.model_validate(
        {
            "name": "pp",
            "model": "tiny-gpt",
            "strategy": "pipeline",
            "parallel": {"pp": 2, "microbatches": 4},
            "workers": {"min": 4, "max": 4},
            "train": {"global_batch_size": 32, "micro_batch_size": 2},
        }
    )
    assert (spec.data_parallel_size(4), spec.samples_per_micro_step(4), spec.accumulation_steps(4)) == (2, 16, 2)
    [error] = _errors(
        strategy="pipeline",
        parallel={"pp": 2, "microbatches": 4},
        workers={"min": 4, "max": 4},
        train={"global_batch_size": 24, "micro_batch_size": 2},
    )
    assert "micro_batch_size × parallel.microbatches × data-parallel size (2 × 4 × 2 = 16)" in error["msg"]


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"strategy": "ddp", "parallel": {"tp": 2}}, "not 'ddp'"),
        ({"strategy": "tensor", "parallel": {"tp": 1}}, "needs parallel.tp >= 2"),
        ({"strategy": "pipeline", "parallel": {"pp": 1}}, "needs parallel.pp >= 2"),
        ({"strategy": "zero1", "parallel": {"shard": "hybrid"}}, "hybrid' applies to strategies fsdp and 3d"),
    ],
)
def test_parallel_fields_must_fit_the_strategy(fields: dict[str, Any], needle: str) -> None:
    [error] = _errors(**fields)
    assert needle in error["msg"]


def test_linear_lr_scaling_follows_data_parallel_replicas() -> None:
    spec = JobSpec.model_validate(
        {
            "name": "tp",
            "model": "tiny-gpt",
            "strategy": "tensor",
            "parallel": {"tp": 2},
            "workers": {"min": 4, "max": 4},
            "train": {"lr": 0.001, "lr_scaling": "linear", "global_batch_size": 8, "micro_batch_size": 4},
        }
    )
    assert spec.scaled_lr(4) == pytest.approx(0.002)


def test_a_builtins_integral_float_size_options_are_stored_as_the_integers_its_builder_needs() -> None:
    spec = JobSpec.model_validate(
        {"name": "floats", "model": "tiny-gpt", "model_options": {"n_layers": 3.0, "dim": 64}}
    )
    assert spec.model_options == {"n_layers": 3, "dim": 64} and isinstance(spec.model_options["n_layers"], int)


def _script_errors(**fields: Any) -> list[ErrorDetails]:
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({"name": "job", **fields})
    return info.value.errors()


def test_a_script_job_needs_no_managed_fields_and_keeps_its_command() -> None:
    spec = JobSpec.model_validate(
        {"name": "job", "command": ["python", "train.py", "--lr", "0.1"], "workers": {"min": 1, "max": 2}}
    )
    assert spec.is_script and spec.model is None and spec.data is None
    assert spec.command == ["python", "train.py", "--lr", "0.1"] and spec.stop_grace_s == 30
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec  # as the driver's handoff carries it


@pytest.mark.parametrize(
    ("fields", "got"), [({}, "neither"), ({"model": "mlp", "command": ["python", "t.py"]}, "both")]
)
def test_model_and_command_are_exclusive_and_one_is_required(fields: dict[str, Any], got: str) -> None:
    [error] = _script_errors(**fields)
    assert error["type"] == "value_conflict"
    assert "give exactly one of model" in error["msg"] and "command" in error["msg"] and f"got {got}" in error["msg"]


@pytest.mark.parametrize(
    ("command", "needle"), [([], "at least 1 item"), (["python", ""], "command[1]: each argument must be 1 to")]
)
def test_an_empty_command_or_argument_is_rejected_on_command(command: list[str], needle: str) -> None:
    [error] = _script_errors(command=command)
    assert error["loc"][0] == "command" and needle in error["msg"]


def test_stop_grace_is_bounded() -> None:
    [error] = _script_errors(command=["python", "t.py"], stop_grace_s=-1)
    assert error["loc"] == ("stop_grace_s",)


def test_the_script_fields_leave_a_managed_jobs_hash_as_it_was() -> None:
    # The hash this spec had before command and stop_grace_s existed: a stored checkpoint's config hash still matches.
    assert JobSpec.model_validate({"name": "job", "model": "mlp"}).spec_hash() == "b3d6bd16d1eb15d7"
