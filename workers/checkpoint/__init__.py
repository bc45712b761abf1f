"""A rank's checkpoints: durable ones in storage and in-memory snapshots in peers' memory, and the trainer's one
component over both (`Checkpointer`: where a run resumes from, the save in flight, commit and retention).

- checkpointer.py: the trainer-facing component.
- durable.py: sharded DCP checkpoints in storage, committed atomically (a manifest written last), verified, retained.
- training_state.py: what a checkpoint, durable or in memory, holds of a rank, and how it is staged and loaded.
- storage.py: where durable checkpoints live (a local directory or any fsspec URI).
- export.py: a committed checkpoint's weights as safetensors (`python -m ringmaster.workers.checkpoint.export`).
- snapshots/: every step's state in peers' host memory, and which snapshot a re-formed group resumes from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ringmaster.workers.checkpoint.checkpointer import Checkpointer

__all__ = ["Checkpointer"]


def __getattr__(name: str) -> Any:
    # Loaded when first asked for: the job driver imports the snapshot choice from this package and must start without
    # torch (tests/workers/driver/test_startup.py), which the Checkpointer needs.
    if name == "Checkpointer":
        from ringmaster.workers.checkpoint.checkpointer import Checkpointer

        return Checkpointer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
