"""A record of which samples every step used (JobSpec train.record_sample_ids), so that
"each sample once per epoch, across failures and resizes" can be checked, not just claimed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class SampleAudit:
    """Appends one line per step: generation (which formation of the group), step, epoch, ids."""

    def __init__(self, storage_root: str, rank: int, dp_rank: int, generation: int) -> None:
        directory = Path(storage_root) / "sample-ids"
        directory.mkdir(parents=True, exist_ok=True)
        # Open for the recorder's life, not a with block: it appends a line every step.
        self._file = open(directory / f"generation-{generation:04d}-rank-{rank:04d}.jsonl", "a")  # noqa: SIM115
        self._fields = {"generation": generation, "rank": rank, "dp_rank": dp_rank}

    def record(self, step: int, epoch: int, sample_ids: list[int]) -> None:
        # Flushed every step: a line must survive the process being killed right after.
        self._file.write(json.dumps({**self._fields, "step": step, "epoch": epoch, "ids": sample_ids}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _records(storage_root: str | Path) -> Iterator[dict[str, Any]]:
    for path in sorted(Path(storage_root, "sample-ids").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            yield json.loads(line)


def read_steps_by_generation(storage_root: str | Path) -> dict[int, set[int]]:
    """generation → the steps that formation of the group computed, from every rank's own record."""
    steps: dict[int, set[int]] = {}
    for record in _records(storage_root):
        steps.setdefault(record["generation"], set()).add(record["step"])
    return steps


def read_effective_samples(storage_root: str | Path) -> dict[int, tuple[int, list[int]]]:
    """step → (epoch, sample ids) as the latest generation that ran the step took them."""
    latest: dict[int, int] = {}
    taken: dict[tuple[int, int], tuple[int, dict[int, list[int]]]] = {}
    for record in _records(storage_root):
        step, generation = record["step"], record["generation"]
        latest[step] = max(latest.get(step, generation), generation)
        _epoch, by_replica = taken.setdefault((step, generation), (record["epoch"], {}))
        by_replica[record["dp_rank"]] = record["ids"]  # tp/pp peers of a replica share its data
    return {
        step: (taken[(step, generation)][0], [i for ids in taken[(step, generation)][1].values() for i in ids])
        for step, generation in sorted(latest.items())
    }
