"""The built-in MLP with a fixed pause in each training forward pass (``model: tests.paced_model:build``).

Steps then take a known time whatever the machine's load, so a failure test strikes mid-job. With ``hold_file``,
they pause only while that file exists: a test holds the job at that pace until the failure it stages is over,
then deletes the file and the remaining steps run at full speed (``release``), instead of pacing a job long
enough for the slowest failure.

With ``id_record_dir``, every sample carries its own index into the model as an extra first input column, and
each training forward pass appends the indices it was given to a file of its process there, with a fingerprint
of the parameters it computed on: a record of which samples each optimizer step used that is independent of
ringmaster's own (``train.record_sample_ids``); read_tagged_steps reads it back.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ringmaster.workers.models import ModelBundle
from ringmaster.workers.models.mlp import build as build_mlp


class IdTagged(Dataset):
    """Each sample with its index prepended to its inputs."""

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, target = self.inner[index]
        return torch.cat([torch.tensor([float(index)]), inputs]), target


class PacedModel(nn.Module):
    def __init__(
        self, inner: nn.Module, pause_s: float, id_record_dir: str | None = None, hold_file: str | None = None
    ) -> None:
        super().__init__()
        self.inner = inner
        self.pause_s = pause_s
        self.id_record_dir = id_record_dir
        self.hold_file = hold_file
        self._record = None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.id_record_dir is not None:
            ids, inputs = inputs[:, 0], inputs[:, 1:]
            if self.training:
                self._write(ids)
        if self.training and (self.hold_file is None or os.path.exists(self.hold_file)):  # validation stays fast
            time.sleep(self.pause_s)
        return self.inner(inputs)

    def _write(self, ids: torch.Tensor) -> None:
        if self._record is None:
            Path(self.id_record_dir).mkdir(parents=True, exist_ok=True)
            # Open for the model's life, not a with block: it appends a line every training forward.
            self._record = open(Path(self.id_record_dir) / f"{os.getpid()}-{id(self):x}.jsonl", "a")  # noqa: SIM115
        fingerprint = hashlib.sha1()
        for parameter in self.inner.parameters():
            fingerprint.update(parameter.detach().cpu().numpy().tobytes())
        self._record.write(
            json.dumps(
                {"at": time.time(), "parameters": fingerprint.hexdigest(), "ids": [int(i) for i in ids.tolist()]}
            )
            + "\n"
        )
        self._record.flush()  # a line must survive the process being killed right after


def build(
    pause_s: float = 0.1, id_record_dir: str | None = None, hold_file: str | None = None, **mlp_options: Any
) -> ModelBundle:
    bundle = build_mlp(**mlp_options)
    bundle.model = PacedModel(bundle.model, pause_s, id_record_dir, hold_file)
    if id_record_dir is not None:
        bundle.train_dataset, bundle.val_dataset = IdTagged(bundle.train_dataset), IdTagged(bundle.val_dataset)
    return bundle


def hold(path: Path) -> str:
    """A hold file for ``model_options.hold_file``: the job's steps are paced until ``release(path)``."""
    path.touch()
    return str(path)


def release(path: str) -> None:
    Path(path).unlink()


def read_tagged_steps(id_record_dir: str | Path) -> tuple[list[set[int]], int]:
    """(the samples of each optimizer step, in the order the steps were computed; the computations left out).

    The forward passes made on the same parameters are one computation of one step (its micro-batches, its ranks).
    A step computed again after a restore is left out when its samples are those of an earlier computation (after
    a resize it is computed on bitwise different parameters), and so is one a failure cut short, whose samples
    are part of a later computation's."""
    computations: dict[str, tuple[float, set[int]]] = {}
    for path in Path(id_record_dir).glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            first, ids = computations.setdefault(record["parameters"], (record["at"], set()))
            computations[record["parameters"]] = (min(first, record["at"]), ids | set(record["ids"]))
    ordered = [ids for _, ids in sorted(computations.values(), key=lambda entry: entry[0])]
    steps = [
        ids
        for index, ids in enumerate(ordered)
        if not any(ids < other for other in ordered) and ids not in ordered[:index]
    ]
    return steps, len(ordered) - len(steps)
