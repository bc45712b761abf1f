"""Data files on a node's local disk: a remote file fetched once per node, and files derived from a data source
(a packed dataset column) written once per node. Every rank of a node opens the same copy, which they then share
through the page cache when memory-mapped.

The cache lies under ``RINGMASTER_DATA_CACHE`` (default: ``ringmaster-data-cache`` in the system's temporary
directory). An entry's name carries a key of what it was made from (a remote file's URI, size and etag or
modification time), so a changed source makes a new entry; nothing is evicted. One rank per node makes an entry
while the others wait on a file lock, and it appears by an atomic rename, so no reader ever sees half a file.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlparse

import fsspec

from ringmaster.workers.job_input import JobInputError

CACHE_ENV = "RINGMASTER_DATA_CACHE"


def cache_dir() -> Path:
    directory = Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "ringmaster-data-cache")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def is_local(path: str) -> bool:
    """A plain path or a file:// URI names a file the node already has."""
    return "://" not in path or urlparse(path).scheme == "file"


def local_path(path: str) -> Path:
    return Path(urlparse(path).path) if path.startswith("file://") else Path(path)


def cache_key(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:24]


def node_local_file(path: str, field: str = "data.path") -> tuple[Path, bool]:
    """The file at ``path`` on this node's disk, and whether this call fetched it: a local path as it is, a remote
    URI from the node's cache (fetched into it by the first rank to ask). A missing file is a JobInputError naming
    it and the spec's `field` that named it."""
    if is_local(path):
        local = local_path(path)
        if not local.is_file():
            raise JobInputError(
                f"{field}: data file {path!r} does not exist on this node"
                if not local.exists()
                else f"{field}: data file {path!r} is not a file"
            )
        return local, False
    filesystem, remote = fsspec.core.url_to_fs(path)
    try:
        info = filesystem.info(remote)
    except FileNotFoundError:
        raise JobInputError(f"{field}: data file {path!r} does not exist") from None
    if info.get("type") != "file":
        raise JobInputError(f"{field}: data file {path!r} is not a file")
    version = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or ""
    name = f"{cache_key(path, info['size'], version)}-{Path(remote).name}"

    def download(out: BinaryIO) -> None:
        with filesystem.open(remote, "rb") as source:
            while chunk := source.read(16 * 1024 * 1024):
                out.write(chunk)

    return made_once(name, download)


def made_once(name: str, write: Callable[[BinaryIO], None]) -> tuple[Path, bool]:
    """The cache entry ``name``, written by ``write`` unless it exists; True when this call wrote it."""
    target = cache_dir() / name
    if target.exists():
        return target, False
    with _locked(target.with_name(target.name + ".lock")):
        if target.exists():  # another rank made it while this one waited
            return target, False
        partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
        try:
            with open(partial, "wb") as out:
                write(out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target, True


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
