"""Built-in models and corpora, and the user entrypoint contract."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ringmaster.service.catalogue import BUILTIN_MODELS
from ringmaster.service.spec import JobSpec, parse_spec_text
from ringmaster.workers.data.pysource import ByteWindows, is_validation_file, stdlib_corpus, stdlib_source_files
from ringmaster.workers.models import EntrypointError, ModelBundle, build_bundle
from ringmaster.workers.models.registry import resolve_entrypoint
from ringmaster.workers.models.tiny_gpt import TinyGPT, TinyGPTConfig

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
SMALL_CORPUS = 65_536


def test_pysource_corpus_is_deterministic_and_split_by_file() -> None:
    train, validation = stdlib_corpus(SMALL_CORPUS)
    rebuilt_train, rebuilt_validation = stdlib_corpus.__wrapped__(SMALL_CORPUS)

    assert torch.equal(train, rebuilt_train) and torch.equal(validation, rebuilt_validation)
    assert len(train) >= SMALL_CORPUS and len(validation) > 0
    files = stdlib_source_files()
    assert not any("/test/" in f"/{path}" or "/tests/" in f"/{path}" or "site-packages" in path for path in files)
    validation_files = [path for path in files if is_validation_file(path)]
    assert 0 < len(validation_files) < len(files) * 0.1
    # The validation text is not inside the training text, and vice versa.
    train_text, validation_text = bytes(train.tolist()), bytes(validation.tolist())
    assert validation_text[:2000] not in train_text
    assert train_text[:2000] not in validation_text


def test_byte_windows_have_stable_ids_and_shifted_targets() -> None:
    tokens = torch.arange(100, dtype=torch.uint8)
    windows = ByteWindows(tokens, seq_len=8)

    assert len(windows) == 12
    inputs, targets = windows[3]
    assert inputs.tolist() == list(range(24, 32)) and targets.tolist() == list(range(25, 33))
    assert inputs.dtype == torch.long
    assert windows[11][1][-1].item() == 96


def test_every_builtin_model_in_the_catalogue_has_a_builder() -> None:
    for model in BUILTIN_MODELS.values():
        assert callable(resolve_entrypoint(model.entrypoint)), model.name


def test_tiny_gpt_predicts_every_position_and_runs_as_a_pipeline_middle_stage() -> None:
    config = TinyGPTConfig(dim=32, n_heads=4, n_layers=2, seq_len=16)
    model = TinyGPT(config)
    tokens = torch.randint(0, 256, (3, 16))

    assert model(tokens).shape == (3, 16, 256)
    assert list(model.layers.keys()) == ["0", "1"]
    # Causality: changing the last token must not change earlier predictions.
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    torch.testing.assert_close(model(changed)[:, :-1], model(tokens)[:, :-1])

    model.tok_embeddings = model.pos_embeddings = model.norm = model.output = None
    hidden = torch.randn(3, 16, 32)
    assert model(hidden).shape == (3, 16, 32)


def test_example_user_model_builds_through_its_spec() -> None:
    spec = parse_spec_text((EXAMPLES / "user-model.yaml").read_text())
    bundle = build_bundle(spec)

    assert spec.model == "examples.user_model:build" and spec.data == "user"
    assert isinstance(bundle, ModelBundle) and len(bundle.train_dataset) > len(bundle.val_dataset) > 0
    inputs, targets = bundle.train_dataset[0]
    assert inputs.shape == targets.shape == (spec.model_options["seq_len"],)
    assert bundle.loss_fn(bundle.model, bundle.train_dataset[:4]).ndim == 0


def build_from_tuple(width: int = 3) -> tuple:
    """A user entrypoint in the short form: (model, train_dataset, loss_fn)."""
    data = TensorDataset(torch.randn(8, width), torch.randn(8, 1))
    return nn.Linear(width, 1), data, lambda model, batch: (model(batch[0]) - batch[1]).pow(2).mean()


def build_without_data(seq_len: int = 16) -> tuple:
    return nn.Linear(seq_len, 1), None, lambda model, batch: model(batch[0].float()).mean()


def build_wrong_type() -> dict:
    return {"model": nn.Linear(1, 1)}


def build_non_module() -> tuple:
    return "not a model", TensorDataset(torch.zeros(2)), lambda model, batch: batch


NOT_CALLABLE = 42


def _spec(model: str, **fields) -> JobSpec:
    return JobSpec(name="entrypoints", model=model, **fields)


def test_tuple_entrypoint_receives_model_options() -> None:
    bundle = build_bundle(_spec(f"{__name__}:build_from_tuple", model_options={"width": 5}))

    assert bundle.model.in_features == 5 and bundle.val_dataset is None
    assert bundle.loss_fn(bundle.model, bundle.train_dataset[:2]).ndim == 0


def test_user_model_on_builtin_corpus_gets_its_windows() -> None:
    spec = _spec(f"{__name__}:build_without_data", data="pysource", model_options={"seq_len": 16})
    bundle = build_bundle(spec)

    assert isinstance(bundle.train_dataset, ByteWindows) and bundle.train_dataset.seq_len == 16
    assert isinstance(bundle.val_dataset, ByteWindows)


@pytest.mark.parametrize(
    ("entrypoint", "options", "message"),
    [
        (
            "no_such_package.models:build",
            {},
            "cannot import module 'no_such_package.models': ModuleNotFoundError: No "
            "module named 'no_such_package'; ship its directory with the job (ringmaster submit --code DIR) or put it "
            "on RINGMASTER_CODE_PATH",
        ),
        (f"{__name__}:missing_builder", {}, "has no attribute 'missing_builder'"),
        (f"{__name__}:NOT_CALLABLE", {}, "'NOT_CALLABLE' is a int, not a function"),
        (f"{__name__}:build_wrong_type", {}, "returned dict; expected a ModelBundle"),
        (f"{__name__}:build_non_module", {}, "model is a str, not a torch.nn.Module"),
        (f"{__name__}:build_from_tuple", {"depth": 2}, "does not accept model_options ['depth']"),
        (f"{__name__}:build_without_data", {}, "returned no train_dataset"),
    ],
)
def test_bad_entrypoint_is_a_clear_error_naming_it(entrypoint: str, options: dict, message: str) -> None:
    with pytest.raises(EntrypointError) as raised:
        build_bundle(_spec(entrypoint, model_options=options))

    assert entrypoint in str(raised.value) and message in str(raised.value)


def test_a_module_whose_own_import_fails_is_named_with_the_failing_import_and_where(
    tmp_path: Path, monkeypatch
) -> None:
    (tmp_path / "needs_a_dependency.py").write_text("import math\nimport a_dependency_nobody_has\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    with pytest.raises(EntrypointError) as raised:
        build_bundle(_spec("needs_a_dependency:build"))

    assert str(raised.value) == (
        "model entrypoint 'needs_a_dependency:build': cannot import module 'needs_a_dependency': "
        "ModuleNotFoundError: No module named 'a_dependency_nobody_has' "
        f"(at {tmp_path / 'needs_a_dependency.py'}:2)"
    )


def test_builtin_model_rejects_unknown_options() -> None:
    with pytest.raises(EntrypointError, match=r"ringmaster.workers.models.tiny_gpt:build"):
        build_bundle(_spec("tiny-gpt", model_options={"layers": 3}))
