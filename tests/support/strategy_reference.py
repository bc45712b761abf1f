"""One process training tiny-gpt on the global batches every parallel layout trains on: the reference
each strategy's losses, gradients and checkpoint are compared with.

DistributedSampler draws one permutation per epoch whatever the number of replicas and deals it
round-robin; a replica takes consecutive micro-batches, so with B/dp samples per replica per step,
step s of every layout trains on the same set, permutation[s·B : (s+1)·B]. One reference serves all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DistributedSampler, default_collate

from ringmaster.service.spec import JobSpec
from ringmaster.workers.models import build_bundle

SEED = 3
GLOBAL_BATCH = 16
LR, WEIGHT_DECAY, WARMUP_STEPS = 3e-3, 0.1, 2
# Four blocks so interleaved 1F1B can place two virtual stages on each of two ranks.
MODEL_OPTIONS = {"n_layers": 4, "dim": 32, "n_heads": 4, "seq_len": 32, "max_corpus_bytes": 32_768}


def strategy_spec(
    name: str,
    strategy: str,
    workers: int,
    steps: int,
    micro_batch_size: int,
    *,
    precision: str = "fp32",
    grad_clip: float | None = None,
    global_batch: int = GLOBAL_BATCH,
    **parallel: Any,
) -> dict[str, Any]:
    """A JobSpec document for ``strategy`` training the reference model on the reference batches."""
    return {
        "name": name,
        "model": "tiny-gpt",
        "model_options": MODEL_OPTIONS,
        "strategy": strategy,
        "parallel": parallel,
        "workers": {"min": workers, "max": workers, "cpus_per_worker": 1},
        "train": {
            "steps": steps,
            "global_batch_size": global_batch,
            "micro_batch_size": micro_batch_size,
            "lr": LR,
            "warmup_steps": WARMUP_STEPS,
            "weight_decay": WEIGHT_DECAY,
            "seed": SEED,
            "precision": precision,
            "grad_clip": grad_clip,
        },
        "checkpoint": {"every_steps": 0, "keep": 1},
    }


@dataclass
class ReferenceRun:
    losses: list[float]
    gradients: list[dict[str, torch.Tensor]]  # per step, by the unsplit model's parameter names, before clipping
    grad_norms: list[float]
    state: dict[str, torch.Tensor]  # the model's weights after the last step


def train_reference(steps: int, grad_clip: float | None = None, global_batch: int = GLOBAL_BATCH) -> ReferenceRun:
    spec = JobSpec.model_validate(
        strategy_spec("reference", "ddp", 1, steps, global_batch, grad_clip=grad_clip, global_batch=global_batch)
    )
    torch.manual_seed(SEED)  # run_training seeds torch with spec.train.seed right before building the bundle
    bundle = build_bundle(spec)
    model = bundle.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = LambdaLR(optimizer, lambda completed: min(1.0, (completed + 1) / WARMUP_STEPS))
    permutation = list(
        DistributedSampler(bundle.train_dataset, num_replicas=1, rank=0, shuffle=True, seed=SEED, drop_last=True)
    )
    run = ReferenceRun([], [], [], {})
    for step in range(steps):
        indices = permutation[step * global_batch : (step + 1) * global_batch]
        loss = bundle.loss_fn(model, default_collate([bundle.train_dataset[i] for i in indices]))
        loss.backward()
        run.gradients.append({name: p.grad.clone() for name, p in model.named_parameters()})
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip is not None else float("inf"))
        run.grad_norms.append(norm.item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        run.losses.append(loss.item())
    run.state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    return run
