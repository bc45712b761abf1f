"""Where a process keeps its snapshots, across every group it joins: the files of each, held as byte tensors or made
from the live state when read; what it holds, for the driver's choice (`inventory`); which it keeps (`retain`)."""

from __future__ import annotations

import pickle
import re
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from ringmaster.workers.checkpoint.snapshots.shard_file import bytes_tensor

SNAPSHOT_ROOT = "ringmaster-snapshots"  # a name in SnapshotStore, not a filesystem path
METADATA_NAME = ".metadata"
SNAPSHOTS_KEPT = 2  # how many snapshots a process keeps: the newest and the one before
_SNAPSHOT_DIR = re.compile(r"^g(\d{4})-step-(\d{8})$")


@dataclass(frozen=True)
class SnapshotRef:
    """Which snapshot: the group generation that took it, after which step."""

    generation: int
    step: int


def _job_root(job_id: str) -> str:
    return f"{SNAPSHOT_ROOT}/{job_id}"


def snapshot_location(job_id: str, ref: SnapshotRef) -> str:
    return f"{_job_root(job_id)}/g{ref.generation:04d}-step-{ref.step:08d}"


class FileMadeWhenRead(ABC):
    """A snapshot file the store does not hold as bytes but makes when it is read (a LiveFile of live state), valid
    only while its source still holds the snapshot's state; `owner` is what made it."""

    owner: object

    @abstractmethod
    def valid(self) -> bool: ...

    @abstractmethod
    def numel(self) -> int:
        """The size of the file it makes, as SnapshotStore.names reports a held file's."""

    @abstractmethod
    def materialize(self) -> torch.Tensor: ...


class SnapshotStore:
    """The snapshots in this process, across every group it joins (a worker actor keeps one for its life): per
    snapshot location, its files as byte tensors (a buddy's copy is kept as it was received, with no further copy)
    or as a FileMadeWhenRead, made from the live state when read, and held only while that state is still the
    snapshot's. The training thread's snapshot writer and the actor's inventory calls share it: a lock guards it."""

    def __init__(self) -> None:
        self._files: dict[str, dict[str, torch.Tensor | FileMadeWhenRead]] = {}
        self._lock = threading.Lock()

    def names(self, location: str) -> dict[str, int]:
        """File name -> size of what this process holds of one snapshot."""
        return {name: content.numel() for name, content in self._held(location).items()}

    def _held(self, location: str) -> dict[str, torch.Tensor | FileMadeWhenRead]:
        """The files of a snapshot held now: copies, and live files while they are valid."""
        with self._lock:
            files = dict(self._files.get(location, {}))
        return {
            name: content
            for name, content in files.items()
            if not isinstance(content, FileMadeWhenRead) or content.valid()
        }

    def hold_copies_of_live(self, owner: object) -> None:
        """Make `owner`'s live files copies held here (those still valid; the rest go): its group's training ended,
        and the next group builds a model of its own, so the old one's memory (a GPU's above all) can be let go."""
        with self._lock:
            live = [
                (location, name, content)
                for location, files in self._files.items()
                for name, content in files.items()
                if isinstance(content, FileMadeWhenRead) and content.owner is owner
            ]
        for location, name, file in live:
            content = file.materialize() if file.valid() else None
            with self._lock:
                files = self._files.get(location, {})
                if files.get(name) is not file:
                    continue
                if content is not None and file.valid():
                    files[name] = content
                else:
                    del files[name]

    def live_names(self, location: str) -> dict[str, int]:
        """Of `names`, the files made from the live state when read (FileMadeWhenRead), not held as copies."""
        return {
            name: content.numel()
            for name, content in self._held(location).items()
            if isinstance(content, FileMadeWhenRead)
        }

    def read(self, location: str, name: str) -> torch.Tensor:
        with self._lock:
            content = self._files.get(location, {}).get(name)
        if isinstance(content, FileMadeWhenRead):
            live, content = content, content.materialize()
            if not live.valid():  # the state moved on while it was copied (or before)
                content = None
        if content is None:
            raise FileNotFoundError(f"{location}/{name}")
        return content

    def read_object(self, location: str, name: str) -> Any:
        return pickle.loads(self.read(location, name).numpy().data)

    def write(self, location: str, name: str, content: torch.Tensor | FileMadeWhenRead | bytes) -> None:
        tensor = bytes_tensor(content) if isinstance(content, bytes) else content
        with self._lock:
            self._files.setdefault(location, {})[name] = tensor

    def snapshots(self, job_id: str) -> list[SnapshotRef]:
        """The snapshots this process holds any file of, oldest first."""
        prefix = f"{_job_root(job_id)}/"
        with self._lock:
            locations = [location for location, files in self._files.items() if files and location.startswith(prefix)]
        found = []
        for location in locations:
            match = _SNAPSHOT_DIR.match(location[len(prefix) :])
            if match:
                found.append(SnapshotRef(int(match.group(1)), int(match.group(2))))
        return sorted(found, key=lambda ref: (ref.generation, ref.step))

    def inventory(self, job_id: str) -> list[dict[str, Any]]:
        """What this process holds, for the driver's choice: per snapshot its files, and (where this process has the
        metadata) what the snapshot needs: groups of files, one of each group (an item's copies) at least."""
        held = []
        for ref in self.snapshots(job_id):
            location = snapshot_location(job_id, ref)
            names = self.names(location)
            required = None
            if METADATA_NAME in names:
                metadata = self.read_object(location, METADATA_NAME)
                required = [
                    list(files)
                    for files in sorted({slot.files() for slot in metadata.storage_data.values()} | {(METADATA_NAME,)})
                ]
            held.append({"generation": ref.generation, "step": ref.step, "files": sorted(names), "required": required})
        return held

    def retain(self, job_id: str, keep: int = SNAPSHOTS_KEPT) -> None:
        """Keep the newest `keep` snapshots this process has the metadata of, and any newer (one being taken)."""
        refs = self.snapshots(job_id)
        complete = [ref for ref in refs if METADATA_NAME in self.names(snapshot_location(job_id, ref))]
        if len(complete) <= keep:
            return
        oldest_kept = complete[-keep]
        with self._lock:
            for ref in refs:
                if (ref.generation, ref.step) < (oldest_kept.generation, oldest_kept.step):
                    self._files.pop(snapshot_location(job_id, ref), None)

    def drop(self, job_id: str) -> None:
        prefix = f"{_job_root(job_id)}/"
        with self._lock:
            for location in [location for location in self._files if location.startswith(prefix)]:
                del self._files[location]
