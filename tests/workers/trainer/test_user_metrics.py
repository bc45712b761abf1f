"""A model's loss_fn may return (loss, {name: value}): each step reports each metric as its mean over the step's
micro-batches and data-parallel ranks, exactly as the loss, under every strategy, and each validation its mean over
the whole validation set as val_<name>, exactly as val_loss; anything else fails the job in one line that says what to
return."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset, default_collate

from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec
from ringmaster.workers.data.stream import epoch_order
from ringmaster.workers.job_input import JobInputError
from ringmaster.workers.models import ModelBundle, build_bundle, tiny_gpt
from ringmaster.workers.models.registry import logits_loss
from ringmaster.workers.trainer import TrainContext, run_training
from ringmaster.workers.trainer.user_metrics import ValidationUserMetrics

LR = 0.5
STEPS = 4
GLOBAL_BATCH = 16
EVAL_EVERY = 2
VALIDATION_SAMPLES = 141  # 71 and 70 on two ranks, each in a batch of 64 and a short one: weights that differ
STRATEGIES = ["ddp", "fsdp"]


def _classifier_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
    inputs, labels = batch
    logits = model(inputs)
    return nn.functional.cross_entropy(logits, labels), {
        "accuracy": (logits.argmax(-1) == labels).float().mean(),  # a tensor
        "confidence": logits.softmax(-1).amax(-1).mean().item(),  # a number
    }


def _labelled(samples: int, generator: torch.Generator) -> TensorDataset:
    inputs = torch.randn(samples, 4, generator=generator)
    return TensorDataset(inputs, (inputs[:, 0] > 0).long() + (inputs[:, 1] > 0.5).long())


def classifier(loss_fn: Any = _classifier_loss) -> ModelBundle:
    """A user model whose loss_fn reports accuracy and confidence beside the loss, on its training and validation
    sets."""
    generator = torch.Generator().manual_seed(3)
    train, val = _labelled(128, generator), _labelled(VALIDATION_SAMPLES, generator)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    return ModelBundle(model, train, val, loss_fn)


def classifier_without_validation() -> ModelBundle:
    bundle = classifier()
    bundle.val_dataset = None
    return bundle


def _spec(name: str, builder: str = "classifier", **extra: Any) -> JobSpec:
    return JobSpec(
        name=name,
        model=f"{__name__}:{builder}",
        data="user",
        train={
            "steps": STEPS,
            "global_batch_size": GLOBAL_BATCH,
            "micro_batch_size": 4,
            "lr": LR,
            "seed": 5,
            "optimizer": {"name": "sgd"},
            "eval_every_steps": EVAL_EVERY,
        },
        **extra,
    )


def _one_process_metrics(
    spec: JobSpec,
) -> tuple[list[tuple[float, float, float]], dict[int, tuple[float, float, float]]]:
    """(loss, accuracy, confidence) of each step's whole global batch, trained by plain torch on one process, and
    every EVAL_EVERY steps those of the whole validation set as one batch, by step."""
    torch.manual_seed(spec.train.seed)
    bundle = build_bundle(spec)
    optimizer = torch.optim.SGD(bundle.model.parameters(), lr=LR)
    order = epoch_order(len(bundle.train_dataset), spec.train.seed, 0).tolist()
    whole_validation_set = default_collate([bundle.val_dataset[i] for i in range(VALIDATION_SAMPLES)])
    steps, validations = [], {}
    for step in range(1, STEPS + 1):
        batch = default_collate(
            [bundle.train_dataset[i] for i in order[(step - 1) * GLOBAL_BATCH : step * GLOBAL_BATCH]]
        )
        loss, metrics = bundle.loss_fn(bundle.model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps.append((loss.item(), metrics["accuracy"].item(), metrics["confidence"]))
        if step % EVAL_EVERY == 0:
            with torch.no_grad():
                loss, metrics = bundle.loss_fn(bundle.model, whole_validation_set)
            validations[step] = (loss.item(), metrics["accuracy"].item(), metrics["confidence"])
    return steps, validations


def gpt_with_metrics(**options: Any) -> ModelBundle:
    """tiny-gpt whose pipeline loss also reports the loss again, as a metric of the user's own."""
    bundle = tiny_gpt.build(**options)

    def output_loss(outputs: torch.Tensor, targets: torch.Tensor) -> Any:
        loss = logits_loss(outputs, targets)
        return loss, {"loss_again": loss}

    bundle.output_loss_fn = output_loss
    return bundle


def _pipeline_spec(world_size: int) -> JobSpec:
    return JobSpec(
        name="metrics-pipeline",
        model=f"{__name__}:gpt_with_metrics",
        model_options={"n_layers": 2, "dim": 16, "n_heads": 2, "seq_len": 16, "max_corpus_bytes": 16_384},
        data="user",
        strategy="pipeline",
        parallel={"pp": 2, "microbatches": 2},
        workers={"min": world_size, "max": world_size},
        train={"steps": 2, "global_batch_size": 8, "micro_batch_size": 2},
    )


def differing_names() -> ModelBundle:
    """Each rank's loss_fn names its metric after the rank: the ranks cannot agree."""
    return classifier(lambda model, batch: (_classifier_loss(model, batch)[0], {f"rank{dist.get_rank()}": 1.0}))


def _trained_metrics(rank: int, world_size: int, root: str, out: str) -> None:
    """Each strategy in turn, then ranks that disagree, in one pair of processes (each spawn costs a torch import)."""
    workers = {"min": world_size, "max": world_size}
    reported: dict[str, Any] = {}
    for strategy in STRATEGIES:
        points: list = []
        run_training(
            _spec(f"metrics-{strategy}", strategy=strategy, workers=workers),
            TrainContext(
                rank,
                world_size,
                torch.device("cpu"),
                strategy,
                f"{root}/{strategy}",
                sink=CallbackSink(on_metric=points.append),
            ),
        )
        reported[strategy] = [(p.loss, p.user_metrics["accuracy"], p.user_metrics["confidence"]) for p in points]
        # As the control plane receives them: the step's own point carries its validation's, beside val_loss.
        reported[f"{strategy} validation"] = {
            p.step: (p.val_loss, p.user_metrics["val_accuracy"], p.user_metrics["val_confidence"])
            for p in points
            if p.val_loss is not None and p.loss is not None and "accuracy" in p.user_metrics
        }
    points = []
    run_training(
        _pipeline_spec(world_size),
        TrainContext(
            rank,
            world_size,
            torch.device("cpu"),
            "pipeline",
            f"{root}/pipeline",
            sink=CallbackSink(on_metric=points.append),
        ),
    )
    reported["pipeline"] = [(p.loss, p.user_metrics["loss_again"]) for p in points if p.loss is not None]
    reported["pipeline validation"] = [
        (p.val_loss, p.user_metrics["val_loss_again"]) for p in points if p.val_loss is not None
    ]
    try:
        run_training(
            _spec("metrics-differ", "differing_names", strategy="ddp", workers=workers),
            TrainContext(rank, world_size, torch.device("cpu"), "differ", f"{root}/differ"),
        )
    except JobInputError as error:
        reported["differing"] = error.reason
    torch.save(reported, f"{out}.{rank}")


def test_user_metrics_are_the_global_batch_mean_under_ddp_fsdp_and_pipeline(tmp_path: Path) -> None:
    out = tmp_path / "metrics.pt"
    run_on_ranks(_trained_metrics, 2, str(tmp_path / "root"), str(out))
    expected, expected_validations = _one_process_metrics(_spec("one-process"))
    reported = torch.load(f"{out}.0")
    for strategy in STRATEGIES:
        assert len(reported[strategy]) == STEPS, strategy
        for step, (got, want) in enumerate(zip(reported[strategy], expected), start=1):
            assert got == pytest.approx(want, abs=1e-6), f"{strategy}, step {step}"
        # val_<name>: the mean over every sample of the validation set, as one process computes it in one batch.
        validations = reported[f"{strategy} validation"]
        assert sorted(validations) == sorted(expected_validations) == [2, 4], strategy
        for step, want in expected_validations.items():
            assert validations[step] == pytest.approx(want, abs=1e-6), f"{strategy}, validation at step {step}"
    # Through the pipeline schedule's output_loss_fn, averaged over its micro-batches as the loss is.
    assert len(reported["pipeline"]) == 2
    for loss, loss_again in reported["pipeline"]:
        assert loss_again == pytest.approx(loss, abs=1e-6)
    assert len(reported["pipeline validation"]) == 1  # at the last step
    for val_loss, val_loss_again in reported["pipeline validation"]:
        assert val_loss_again == pytest.approx(val_loss, abs=1e-6)
    for rank in (0, 1):  # every rank fails alike, so none waits for the others in the step's all-reduce
        assert torch.load(f"{out}.{rank}")["differing"] == (
            "the model's loss_fn returned different metrics on different ranks (rank 0: ['rank0']; rank 1: "
            "['rank1']): it must return the same names on every rank"
        )


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return _classifier_loss(model, batch)[0]


def metrics_in_a_list() -> ModelBundle:
    return classifier(lambda model, batch: (_loss(model, batch), [0.5]))


def per_sample_metric() -> ModelBundle:
    return classifier(lambda model, batch: (_loss(model, batch), {"accuracy": torch.ones(4)}))


def a_name_of_ringmasters() -> ModelBundle:
    return classifier(lambda model, batch: (_loss(model, batch), {"grad_norm": 1.0}))


def a_name_with_a_space() -> ModelBundle:
    return classifier(lambda model, batch: (_loss(model, batch), {"top 5": 1.0}))


def too_many_metrics() -> ModelBundle:
    return classifier(lambda model, batch: (_loss(model, batch), {f"m{index}": 1.0 for index in range(33)}))


def a_name_of_validations() -> ModelBundle:
    return classifier(lambda model, batch: (_loss(model, batch), {"val_accuracy": 1.0}))


def names_that_change() -> ModelBundle:
    calls = iter(range(1_000))
    return classifier(lambda model, batch: (_loss(model, batch), {"accuracy" if next(calls) < 2 else "acc": 1.0}))


RETURN = 'return the loss alone, or (loss, {"name": value, …}) with each value a number or a one-element tensor'


@pytest.mark.parametrize(
    ("builder", "message"),
    [
        ("metrics_in_a_list", f"the model's loss_fn returned a tuple of (Tensor, list): {RETURN}"),
        ("per_sample_metric", f"the model's loss_fn returned metric 'accuracy' as a tensor of shape (4,): {RETURN}"),
        (
            "a_name_of_ringmasters",
            "the model's loss_fn returned a metric named 'grad_norm', which ringmaster reports itself: name it "
            "otherwise",
        ),
        (
            "a_name_with_a_space",
            "the model's loss_fn returned a metric named 'top 5': a metric's name is 1 to 64 letters, digits, '_', "
            "'.', '-' or '/', starting with a letter",
        ),
        (
            "a_name_of_validations",
            "the model's loss_fn returned a metric named 'val_accuracy': ringmaster reports a metric's value over "
            "the validation set as val_<name> itself, so name it otherwise",
        ),
        ("too_many_metrics", "the model's loss_fn returned 33 metrics: a job reports at most 32"),
        (
            "names_that_change",
            "the model's loss_fn returned metrics ['acc'] after returning ['accuracy']: it must return the same names "
            "at every step",
        ),
    ],
)
def test_a_loss_fn_returning_metrics_wrongly_fails_in_one_line_saying_what_to_return(
    tmp_path: Path, single_rank_group: None, builder: str, message: str
) -> None:
    spec = _spec("bad-metrics", builder)
    spec.train.global_batch_size = 8  # two micro-batches a step: names_that_change changes within the second step
    with pytest.raises(JobInputError) as raised:
        run_training(spec, TrainContext(0, 1, torch.device("cpu"), "bad-metrics", str(tmp_path)))
    assert raised.value.reason == message


def test_keep_best_by_a_metric_of_the_loss_fns_own_keeps_the_checkpoint_of_its_best_step(
    tmp_path: Path, single_rank_group: None
) -> None:
    spec = _spec(
        "best-accuracy", checkpoint={"every_steps": 1, "keep": 1, "keep_best": {"metric": "confidence", "mode": "max"}}
    )
    points: list = []
    records: list = []
    sink = CallbackSink(on_metric=points.append, on_checkpoint=records.append)
    run_training(spec, TrainContext(0, 1, torch.device("cpu"), "best-accuracy", str(tmp_path), sink=sink))
    confidence = {point.step: point.user_metrics["confidence"] for point in points if point.user_metrics}
    assert [(record.step, record.metric, record.metric_value) for record in records] == [
        (step, "confidence", pytest.approx(confidence[step])) for step in range(1, STEPS + 1)
    ]
    best = max(confidence, key=confidence.__getitem__)
    assert records[-1].best_uri.endswith(f"step-{best:08d}")

    unknown = _spec("best-precision", checkpoint={"every_steps": 1, "keep_best": {"metric": "precision"}})
    with pytest.raises(JobInputError) as raised:
        run_training(unknown, TrainContext(0, 1, torch.device("cpu"), "best-precision", str(tmp_path / "unknown")))
    assert raised.value.reason == (
        "checkpoint.keep_best.metric 'precision' is neither loss, val_loss, a metric the model's loss_fn returns nor "
        "val_<one of those> (it returns the metrics ['accuracy', 'confidence'], as (loss, {name: value}))"
    )


def test_keep_best_by_a_validation_metric_of_the_loss_fns_own_keeps_the_checkpoint_of_its_best_validation(
    tmp_path: Path, single_rank_group: None
) -> None:
    # mode min: the best is not simply the newest checkpoint, which keep: 1 keeps anyway.
    spec = _spec(
        "best-val-accuracy",
        checkpoint={"every_steps": 1, "keep": 1, "keep_best": {"metric": "val_accuracy", "mode": "min"}},
    )
    points: list = []
    records: list = []
    sink = CallbackSink(on_metric=points.append, on_checkpoint=records.append)
    run_training(spec, TrainContext(0, 1, torch.device("cpu"), "best-val-accuracy", str(tmp_path), sink=sink))
    # Every checkpoint is validated, and its point carries val_accuracy beside the step's own accuracy.
    validated = {point.step: point.user_metrics for point in points if point.val_loss is not None}
    assert sorted(validated) == list(range(1, STEPS + 1))
    assert all({"accuracy", "val_accuracy", "val_confidence"} <= set(metrics) for metrics in validated.values())
    accuracy = {step: metrics["val_accuracy"] for step, metrics in validated.items()}
    assert [(record.step, record.metric, record.metric_value) for record in records] == [
        (step, "val_accuracy", pytest.approx(accuracy[step])) for step in range(1, STEPS + 1)
    ]
    best = min(sorted(accuracy, reverse=True), key=accuracy.__getitem__)  # the newest among equals
    assert best < STEPS, f"the test needs a best that is not the newest: {accuracy}"
    assert records[-1].best_uri.endswith(f"step-{best:08d}")


@pytest.mark.parametrize(
    ("builder", "metric", "message"),
    [
        (
            "classifier",
            "val_precision",
            "checkpoint.keep_best.metric 'val_precision' is neither val_loss nor val_<name> for a metric the model's "
            "loss_fn returns on the validation set (it returns the metrics ['accuracy', 'confidence'] there, as (loss, "
            "{name: value}))",
        ),
        (
            "classifier_without_validation",
            "val_accuracy",
            f"checkpoint.keep_best.metric 'val_accuracy' needs a validation set, and model "
            f"'{__name__}:classifier_without_validation' has none",
        ),
    ],
)
def test_keep_best_by_a_validation_metric_it_cannot_have_fails_in_one_line(
    tmp_path: Path, single_rank_group: None, builder: str, metric: str, message: str
) -> None:
    spec = _spec("best-unknown", builder, checkpoint={"every_steps": 1, "keep_best": {"metric": metric}})
    if builder == "classifier_without_validation":
        spec.train.eval_every_steps = 0
    with pytest.raises(JobInputError) as raised:
        run_training(spec, TrainContext(0, 1, torch.device("cpu"), "best-unknown", str(tmp_path)))
    assert raised.value.reason == message


def test_validation_weights_each_batch_by_its_samples_and_fails_alike_where_names_change(
    single_rank_group: None,
) -> None:
    validation = ValidationUserMetrics(torch.device("cpu"))
    validation.start()
    validation.add({"accuracy": torch.tensor(1.0)}, 3)
    validation.add({"accuracy": torch.tensor(0.0)}, 1)
    validation.add({"accuracy": torch.tensor(float("nan"))}, 0)  # padding counts for nothing
    totals = validation.into(torch.tensor([2.0, 4.0], dtype=torch.float64))
    assert totals.tolist() == [2.0, 4.0, 0.0, 3.0]  # the built-in sums, the vote, the weighted sum
    assert validation.means(totals.tolist()[2:], 4) == {"accuracy": 0.75}

    validation.start()  # a later evaluation whose batches return other names
    validation.add({"accuracy": torch.tensor(1.0)}, 2)
    validation.add({"acc": torch.tensor(1.0)}, 2)
    totals = validation.into(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(JobInputError) as raised:
        validation.means(totals.tolist()[2:], 4)
    assert raised.value.reason == (
        "the model's loss_fn returned other metrics on the validation set than ['accuracy'], on some rank or batch: "
        "it must return the same names for every batch and on every rank"
    )
