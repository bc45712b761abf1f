"""The validation loss is the mean over every sample of the validation set, whatever the strategy and the world
size: a set that does not divide among the data-parallel ranks, or into a pipeline's batches, loses no sample to
either (a resize would otherwise change which samples the curve is measured on)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from harness.process_group import run_on_ranks
from ringmaster.service.spec import JobSpec
from ringmaster.workers.models import build_bundle
from ringmaster.workers.trainer import TrainContext, run_training
from ringmaster.workers.trainer.validator import validation_batches

SEQ_LEN = 8
VALIDATION_SAMPLES = 13  # divides neither among 2 ranks nor into the pipeline's batches of 4
SEED = 5


def _spec(data_dir: str, strategy: str, **parallel) -> JobSpec:
    # A learning rate this small leaves the weights as built: every layout is evaluated on the same model.
    return JobSpec.model_validate(
        {
            "name": "validation",
            "model": "tiny-gpt",
            "strategy": strategy,
            "parallel": parallel,
            "model_options": {"n_layers": 2, "dim": 16, "n_heads": 2, "seq_len": SEQ_LEN},
            "data": {
                "kind": "tokens",
                "path": f"{data_dir}/train.bin",
                "val_path": f"{data_dir}/val.bin",
                "seq_len": SEQ_LEN,
            },
            "workers": {"min": 2, "max": 2},
            "train": {
                "steps": 1,
                "global_batch_size": 8,
                "micro_batch_size": 2,
                "lr": 1e-12,
                "weight_decay": 0.0,
                "seed": SEED,
            },
        }
    )


LAYOUTS = {
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {"shard": "zero3"}),
    "pipeline": ("pipeline", {"pp": 2, "microbatches": 2, "schedule": "1f1b"}),
}


def _validate_every_layout(rank: int, world_size: int, data_dir: str) -> None:
    losses = {}
    for name, (strategy, parallel) in LAYOUTS.items():
        result = run_training(
            _spec(data_dir, strategy, **parallel),
            TrainContext(rank, world_size, torch.device("cpu"), name, f"{data_dir}/{name}"),
        )
        losses[name] = result.val_loss
    if rank == 0:
        Path(data_dir, "val_losses.json").write_text(json.dumps(losses))


def test_every_layout_validates_on_every_sample_as_one_process_does(tmp_path: Path) -> None:
    generator = np.random.default_rng(0)
    generator.integers(0, 256, 400).astype(np.uint16).tofile(tmp_path / "train.bin")
    # Samples of one repeated byte each, so their losses differ and a sample left out moves the mean.
    np.repeat(np.arange(VALIDATION_SAMPLES + 1) * 19, SEQ_LEN)[: VALIDATION_SAMPLES * SEQ_LEN + 1].astype(
        np.uint16
    ).tofile(tmp_path / "val.bin")

    run_on_ranks(_validate_every_layout, 2, str(tmp_path))

    torch.manual_seed(SEED)  # run_training seeds torch with spec.train.seed right before building the bundle
    bundle = build_bundle(_spec(str(tmp_path), "ddp"))
    assert len(bundle.val_dataset) == VALIDATION_SAMPLES
    with torch.no_grad():
        per_sample = [
            bundle.loss_fn(bundle.model, default_collate([bundle.val_dataset[i]])).item()
            for i in range(VALIDATION_SAMPLES)
        ]
    expected = sum(per_sample) / VALIDATION_SAMPLES
    assert max(per_sample) - min(per_sample) > 1e-3, "a sample left out must move the mean measurably"
    losses = json.loads((tmp_path / "val_losses.json").read_text())
    assert losses == pytest.approx({name: expected for name in LAYOUTS}, abs=1e-6), losses


@pytest.mark.parametrize("samples", [1, 5, 13, 64, 67, 200])
@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize(("batch_size", "microbatches"), [(64, None), (4, None), (8, 2), (12, 4), (4, 4)])
def test_validation_batches_count_each_sample_once_and_every_rank_runs_as_many(
    samples: int, dp: int, batch_size: int, microbatches: int | None
) -> None:
    counted: dict[int, int] = {}
    batch_counts = set()
    for rank in range(dp):
        batches = validation_batches(samples, dp, rank, batch_size, microbatches)
        batch_counts.add(len(batches))
        for ids, per_micro in batches:
            if microbatches is None:
                assert len(per_micro) == 1 and len(ids) <= batch_size
                micro = [ids]
            else:
                assert len(ids) == batch_size and len(per_micro) == microbatches, (
                    "a pipeline batch has its training shape"
                )
                size = batch_size // microbatches
                micro = [ids[i * size : (i + 1) * size] for i in range(microbatches)]
            for chunk, weight in zip(micro, per_micro):
                if weight == 0:
                    continue
                # It counts its distinct samples, or, made of copies of one sample, that one.
                assert weight == len(set(chunk)) and weight in (len(chunk), 1)
                assert {sample % dp for sample in chunk} == {rank}, "a rank counts only its own samples"
                for sample in set(chunk):
                    counted[sample] = counted.get(sample, 0) + 1
    assert counted == {sample: 1 for sample in range(samples)}
    assert len(batch_counts) == 1, "every rank runs the same number of forwards"
