"""Which in-memory snapshot a re-formed group resumes from (this package), chosen by the driver from
what each member says it holds: the newest one whose every file some member holds. Plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SnapshotChoice:
    """`chosen`: {"generation", "step"} to resume from, or None; `why_not`: when none is chosen but some snapshot was
    held, what it lacked (the event that says the group falls back to the durable checkpoint)."""

    chosen: dict[str, int] | None
    why_not: str | None = None


def choose_snapshot(inventories: list[list[dict[str, Any]]]) -> SnapshotChoice:
    """`inventories`: each member's `SnapshotStore.inventory()`."""
    held: dict[tuple[int, int], set[str]] = {}
    required: dict[tuple[int, int], list[list[str]]] = {}  # per snapshot: groups of files, one of each needed
    for inventory in inventories:
        for snapshot in inventory:
            key = (snapshot["generation"], snapshot["step"])
            held.setdefault(key, set()).update(snapshot["files"])
            if snapshot["required"] is not None:
                required[key] = snapshot["required"]

    def lacking(key: tuple[int, int]) -> list[list[str]]:
        return [files for files in required[key] if not held[key] & set(files)]

    for key in sorted(held, reverse=True):
        if key in required and not lacking(key):
            return SnapshotChoice({"generation": key[0], "step": key[1]})
    if not held:
        return SnapshotChoice(None)
    newest = max(held)
    if newest not in required:
        missing = "its metadata (every rank that held it is gone)"
    else:
        missing = (
            ", ".join(" or ".join(files) for files in lacking(newest)) + " (a shard and every copy of it are lost)"
        )
    return SnapshotChoice(None, f"the in-memory snapshot of step {newest[1]} lacks {missing}")
