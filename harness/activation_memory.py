"""The peak activation memory of one forward and backward with a given activation checkpointing mode, as torch's
MemTracker counts it (device-agnostic, so it measures on CPU too). Shared by tests and bench/memory.py."""

from __future__ import annotations

import torch

from ringmaster.service.spec import JobSpec
from ringmaster.workers.models import build_bundle
from ringmaster.workers.strategies.blocks import repeated_blocks
from ringmaster.workers.strategies.per_block import apply_activation_checkpointing
from ringmaster.workers.torch_internals import MemTracker


def peak_activation_bytes(spec: JobSpec, mode: str, batch_size: int = 8) -> int:
    bundle = build_bundle(spec)
    apply_activation_checkpointing(repeated_blocks(bundle.model), mode)
    inputs, targets = next(iter(torch.utils.data.DataLoader(bundle.train_dataset, batch_size=batch_size)))
    tracker = MemTracker()
    tracker.track_external(bundle.model)
    with tracker:
        bundle.loss_fn(bundle.model, (inputs, targets)).backward()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    return next(value for kind, value in peak.items() if str(kind).endswith("ACT"))
