"""Two DDP ranks with gradient accumulation must train exactly like one process on the global batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import default_collate

from harness.checkpoints import latest_committed, load_model_weights
from harness.process_group import run_on_ranks
from harness.sinks import CallbackSink
from ringmaster.service.spec import JobSpec
from ringmaster.workers.models import build_bundle
from ringmaster.workers.trainer import TrainContext, run_training

WORLD_SIZE = 2
SEED = 3
STEPS = 5
GLOBAL_BATCH, MICRO_BATCH = 16, 4
ACCUMULATION = GLOBAL_BATCH // (MICRO_BATCH * WORLD_SIZE)
# mlp: 48 samples make 3 steps per epoch, so 5 steps cross an epoch boundary.
MODEL_OPTIONS = {
    "tiny-gpt": {"n_layers": 2, "dim": 32, "n_heads": 4, "seq_len": 32, "max_corpus_bytes": 32_768},
    "mlp": {"n_train": 48, "n_val": 16},
}


def numerics_spec(model: str) -> JobSpec:
    return JobSpec(
        name="numerics",
        model=model,
        model_options=MODEL_OPTIONS[model],
        workers={"min": WORLD_SIZE, "max": WORLD_SIZE},
        train={
            "steps": STEPS,
            "global_batch_size": GLOBAL_BATCH,
            "micro_batch_size": MICRO_BATCH,
            "lr": 3e-3,
            "warmup_steps": 2,
            "weight_decay": 0.1,
            "seed": SEED,
        },
    )


def _train_every_model(rank: int, world_size: int, root: str) -> None:
    """Runs on each rank: train each model, recording the step losses and the gradient each optimizer step sees."""
    step_gradients: list[torch.Tensor] = []

    def record_gradient(optimizer, args, kwargs) -> None:
        step_gradients.append(
            torch.cat([p.grad.flatten() for group in optimizer.param_groups for p in group["params"]])
        )

    hook = register_optimizer_step_pre_hook(record_gradient)
    try:
        for model in MODEL_OPTIONS:
            step_gradients.clear()
            points = []
            context = TrainContext(
                rank,
                world_size,
                torch.device("cpu"),
                "numerics",
                f"{root}/{model}",
                sink=CallbackSink(on_metric=points.append),
            )
            run_training(numerics_spec(model), context)
            if rank == 0:
                Path(f"{root}/{model}/losses.json").write_text(
                    json.dumps([p.loss for p in points if p.loss is not None])
                )
                torch.save(list(step_gradients), f"{root}/{model}/gradients.pt")
    finally:
        hook.remove()


@pytest.fixture(scope="module")
def distributed_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ddp")
    run_on_ranks(_train_every_model, WORLD_SIZE, str(root))
    return root


def global_batches(dataset, steps: int) -> tuple[list[list[int]], int]:
    """Each step's global batch by the data contract: the next global_batch_size samples of the epoch's
    shuffled order, an epoch holding only whole global batches; also returns how many epochs were started."""
    global_batch = MICRO_BATCH * ACCUMULATION * WORLD_SIZE
    batches, epoch = [], 0
    while len(batches) < steps:
        generator = torch.Generator()
        generator.manual_seed(SEED + epoch)
        order = torch.randperm(len(dataset), generator=generator).tolist()
        batches += [order[i * global_batch : (i + 1) * global_batch] for i in range(len(dataset) // global_batch)]
        epoch += 1
    return batches[:steps], epoch


@pytest.mark.parametrize("model_name", list(MODEL_OPTIONS))
def test_ddp_grad_accumulation_matches_single_process(distributed_runs: Path, model_name: str) -> None:
    spec = numerics_spec(model_name)
    torch.manual_seed(SEED)  # run_training seeds torch with spec.train.seed right before building the bundle
    bundle = build_bundle(spec)
    model = bundle.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = LambdaLR(optimizer, lambda completed: min(1.0, (completed + 1) / 2))
    batches, epochs = global_batches(bundle.train_dataset, STEPS)
    if model_name == "mlp":
        assert epochs > 1, "the mlp case is meant to cross an epoch boundary"

    losses, gradients = [], []
    for indices in batches:
        assert len(indices) == GLOBAL_BATCH
        loss = bundle.loss_fn(model, default_collate([bundle.train_dataset[i] for i in indices]))
        loss.backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    run_dir = distributed_runs / model_name
    distributed_losses = json.loads((run_dir / "losses.json").read_text())
    assert distributed_losses == pytest.approx(losses, abs=1e-5)
    distributed_gradients = torch.load(run_dir / "gradients.pt")
    assert len(distributed_gradients) == STEPS
    for step, (distributed, reference) in enumerate(zip(distributed_gradients, gradients), start=1):
        torch.testing.assert_close(
            distributed, reference, rtol=1e-4, atol=1e-6, msg=lambda m, step=step: f"step {step} gradient: {m}"
        )

    torch.manual_seed(SEED + 1)
    trained = build_bundle(spec).model
    load_model_weights(latest_committed(run_dir).path, trained)
    for (name, expected), actual in zip(model.state_dict().items(), trained.state_dict().values()):
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
