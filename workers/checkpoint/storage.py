"""Where checkpoint files live: a local directory (a plain path or ``file://``), or any fsspec URI
(``s3://``, ``gs://``, ``memory://``, ...).

Local storage keeps the plain-file fast path (pathlib, DCP's FileSystemWriter, fsync'd renames).
Other URIs go through fsspec, and their shards through DCP's FsspecWriter/FsspecReader. Credentials
and endpoints come from the environment the way each fsspec backend reads them (for s3fs:
``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL_S3``...; for any backend: ``FSSPEC_<PROTOCOL>_<OPTION>``).
"""

from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

import fsspec
from fsspec import AbstractFileSystem
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, StorageReader, StorageWriter

from ringmaster.workers.torch_internals import FsspecReader, FsspecWriter


class CheckpointStorage(ABC):
    """The few file operations checkpoints need; every location is a string under one storage's scheme.

    `reads` counts, per process, the calls that read storage (listings, file reads, DCP readers made): recovery from
    peers' memory is checked to make none."""

    reads: ClassVar[int] = 0

    @abstractmethod
    def join(self, location: str, name: str) -> str: ...

    @abstractmethod
    def entries(self, location: str) -> list[str]:
        """Names directly under ``location`` (files and directories); [] when it does not exist."""

    @abstractmethod
    def files(self, location: str) -> dict[str, int]:
        """Size in bytes of every plain file directly under ``location``."""

    @abstractmethod
    def read_bytes(self, location: str) -> bytes | None:
        """The file's content, or None when it cannot be read."""

    @abstractmethod
    def write_text_atomically(self, location: str, text: str) -> None:
        """Readers see either no file or all of ``text``."""

    @abstractmethod
    def remove_tree(self, location: str) -> None:
        """Delete a directory and everything under it; nothing there is fine."""

    @abstractmethod
    def make_dirs(self, location: str) -> None: ...

    @abstractmethod
    def writer(self, location: str) -> StorageWriter:
        """DCP's writer for a checkpoint directory."""

    @abstractmethod
    def reader(self, location: str) -> StorageReader:
        """DCP's reader for a checkpoint directory."""


class LocalStorage(CheckpointStorage):
    def join(self, location: str, name: str) -> str:
        return os.path.join(location, name)

    def entries(self, location: str) -> list[str]:
        CheckpointStorage.reads += 1
        try:
            return [entry.name for entry in Path(location).iterdir()]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def files(self, location: str) -> dict[str, int]:
        CheckpointStorage.reads += 1
        return {entry.name: entry.stat().st_size for entry in Path(location).iterdir() if entry.is_file()}

    def read_bytes(self, location: str) -> bytes | None:
        CheckpointStorage.reads += 1
        try:
            return Path(location).read_bytes()
        except OSError:
            return None

    def write_text_atomically(self, location: str, text: str) -> None:
        partial = location + ".partial"
        with open(partial, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, location)

    def remove_tree(self, location: str) -> None:
        shutil.rmtree(location, ignore_errors=True)

    def make_dirs(self, location: str) -> None:
        Path(location).mkdir(parents=True, exist_ok=True)

    def writer(self, location: str) -> StorageWriter:
        return FileSystemWriter(location)

    def reader(self, location: str) -> StorageReader:
        CheckpointStorage.reads += 1
        return FileSystemReader(location)


class FsspecStorage(CheckpointStorage):
    """Any fsspec filesystem. Listings are never served from fsspec's cache: other ranks and other
    processes write and delete checkpoints, and every rank must see the same set."""

    def __init__(self, fs: AbstractFileSystem) -> None:
        self.fs = fs

    def join(self, location: str, name: str) -> str:
        return f"{location.rstrip('/')}/{name}"

    def _listing(self, location: str) -> list[dict[str, Any]]:
        self.fs.invalidate_cache(location)
        try:
            listing: list[dict[str, Any]] = self.fs.ls(location, detail=True)
            return listing
        except (FileNotFoundError, NotADirectoryError):
            return []

    def entries(self, location: str) -> list[str]:
        CheckpointStorage.reads += 1
        return [_basename(entry["name"]) for entry in self._listing(location)]

    def files(self, location: str) -> dict[str, int]:
        CheckpointStorage.reads += 1
        return {
            _basename(entry["name"]): int(entry["size"]) for entry in self._listing(location) if entry["type"] == "file"
        }

    def read_bytes(self, location: str) -> bytes | None:
        CheckpointStorage.reads += 1
        try:
            content: bytes = self.fs.cat_file(location)
            return content
        except (OSError, ValueError):
            return None

    def write_text_atomically(self, location: str, text: str) -> None:
        # One PUT on object stores: the object appears whole or not at all. Elsewhere a torn write
        # leaves text that does not parse, which readers of manifests already treat as absent.
        self.fs.pipe_file(location, text.encode())

    def remove_tree(self, location: str) -> None:
        try:
            self.fs.rm(location, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(location)

    def make_dirs(self, location: str) -> None:
        self.fs.makedirs(location, exist_ok=True)

    def writer(self, location: str) -> StorageWriter:
        return FsspecWriter(location)

    def reader(self, location: str) -> StorageReader:
        CheckpointStorage.reads += 1
        return FsspecReader(location)


def _basename(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1]


_LOCAL = LocalStorage()


def storage_for(location: str | Path) -> tuple[CheckpointStorage, str]:
    """The storage that holds ``location`` and the location in that storage's own form."""
    text = str(location)
    if isinstance(location, Path) or "://" not in text:
        return _LOCAL, text
    parsed = urlparse(text)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(
                f"checkpoint storage {text!r}: a file:// URI names a path on this machine, not host {parsed.netloc!r}"
            )
        return _LOCAL, parsed.path
    try:
        fs, _ = fsspec.core.url_to_fs(text)
    except (ImportError, ValueError) as error:
        raise ValueError(f"checkpoint storage {text!r}: {error}") from error
    return FsspecStorage(fs), text
