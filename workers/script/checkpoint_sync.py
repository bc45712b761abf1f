"""RINGMASTER_CHECKPOINT_DIR on remote storage (s3://, gs://, any fsspec URI): a directory on each node, made the
same as the job's checkpoint place on the storage before the script starts, and uploaded there while the script runs
and once more after it ends, so a group restarted on other nodes finds what the last one saved.

The rules (docs/jobs/script-mode.md, "Checkpoints on remote storage", says them to users):
- Before a start, the directory becomes a copy of the storage: files the storage has are downloaded where this node's
  copy differs, files it lacks are removed. Every node's ranks then see the same files.
- While the script runs, every UPLOAD_EVERY_S a pass uploads the files written since their last upload, by top-level
  entry (a file, or a directory such as a Trainer's checkpoint-<step>/ with everything under it): an entry is uploaded
  once nothing in it was written for SETTLE_S, its files oldest first. A file written again during its upload is
  uploaded again at a later pass. A file the script deleted that this node had is deleted from the storage.
- After the script's process ends (exit, or a stop's SIGTERM and grace), a final pass uploads every change at once.
- Every worker of a node runs the passes over the node's one directory, one at a time (a file lock), from a state
  file beside it that says which version of each file the storage has. Each node uploads what its scripts wrote:
  a name written on two nodes holds whichever was uploaded last.

Failures never raise out of a pass: they become notes (a line for the driver's log and the job's events), and a
failed upload is retried at the next pass.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from ringmaster.service.reports import SCRIPT_FINAL_UPLOAD_WAIT_S

UPLOAD_EVERY_S = 5.0  # a pass over the directory while the script runs
SETTLE_S = 5.0  # an entry is uploaded once nothing in it was written for this long (a file being written is not)
FINAL_UPLOAD_WAIT_S = SCRIPT_FINAL_UPLOAD_WAIT_S  # what a stop waits, past the script's end, for the final pass
FINAL_TRIES = 3  # the final pass is tried again this many times in all: no later pass would retry it
FILL_TRIES = 3  # a start's download likewise
_RETRY_WAIT_S = 1.0  # doubled at each try
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}  # no directories to make

log = logging.getLogger("ringmaster.script.checkpoint_sync")


@dataclass
class Synced:
    """What one download or upload pass did."""

    files: int = 0  # downloaded or uploaded
    bytes: int = 0
    removed: int = 0  # removed from this node's directory (download) or from the storage (upload)
    failed: int = 0
    waiting: int = 0  # upload: changed files not settled yet
    seconds: float = 0.0
    error: str | None = None  # the first failure, in one line


Note = tuple[int, str]  # (logging level, one line)


class CheckpointSync:
    """One node's RINGMASTER_CHECKPOINT_DIR kept the same as `remote_uri`. Methods are safe to call from several
    threads and processes of the node at once: each takes the node's lock."""

    def __init__(
        self,
        local_dir: str,
        remote_uri: str,
        *,
        every_s: float = UPLOAD_EVERY_S,
        settle_s: float = SETTLE_S,
        clock: Callable[[], float] = time.time,
        retry_wait_s: float = _RETRY_WAIT_S,
    ) -> None:
        """`clock`: wall time, compared with the files' modification times."""
        self.local = Path(local_dir)
        self.remote_uri = remote_uri.rstrip("/")
        self._every_s, self._settle_s, self._clock, self._retry_wait_s = every_s, settle_s, clock, retry_wait_s
        beside = self.local.parent
        self._state_file = beside / f".{self.local.name}.sync.json"
        self._lock_file = beside / f".{self.local.name}.sync.lock"
        self._staging = beside / f".{self.local.name}.download"
        self._filesystem: tuple[AbstractFileSystem, str] | None = None
        self._notes: deque[Note] = deque(maxlen=100)
        self._notes_lock = threading.Lock()
        self._failing = False  # the last pass failed: said once, until a pass succeeds
        self.finished = threading.Event()  # the final pass is over (follow)

    # -- before a start --------------------------------------------------------------------------

    def fill(self) -> Synced:
        """Make the directory a copy of the storage (tried FILL_TRIES times); `error` says why it could not."""
        began = time.monotonic()
        error = None
        for attempt in range(FILL_TRIES):
            try:
                with self._locked():
                    filled = self._fill()
                filled.seconds = time.monotonic() - began
                return filled
            except Exception as failure:  # any backend's error: said in one line by the caller
                error = _describe(failure)
                log.warning("filling %s from %s failed (try %d): %s", self.local, self.remote_uri, attempt + 1, error)
                if attempt + 1 < FILL_TRIES:
                    time.sleep(self._retry_wait_s * 2**attempt)
        return Synced(error=error, seconds=time.monotonic() - began)

    def _fill(self) -> Synced:
        fs, root = self._fs()
        fs.invalidate_cache(root)  # other nodes wrote there: never a cached listing
        try:
            listing: dict[str, dict[str, Any]] = fs.find(root, detail=True)
        except FileNotFoundError:
            listing = {}
        remote = {
            relative: entry
            for name, entry in listing.items()
            if entry.get("type", "file") == "file" and (relative := _relative(name, root))
        }
        self.local.mkdir(parents=True, exist_ok=True)
        state = self._load_state()
        local = self._local_files()
        filled = Synced()
        shutil.rmtree(self._staging, ignore_errors=True)
        self._staging.mkdir(parents=True)
        try:
            for relative, entry in sorted(remote.items()):
                version = _version(entry)
                record, present = state.get(relative), local.get(relative)
                if record and present and record == {"local": _stat_key(present), "remote": version}:
                    continue  # this node has the storage's version, unchanged
                target = self.local / relative
                staged = self._staging / str(filled.files)  # a half-downloaded file is never seen under its name
                fs.get_file(f"{root}/{relative}", str(staged))
                modified = _timestamp(entry)
                if modified is not None:  # the upload's time: "newest by mtime" picks what was saved last
                    os.utime(staged, (modified, modified))
                target.parent.mkdir(parents=True, exist_ok=True)
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                os.replace(staged, target)
                state[relative] = {"local": _stat_key(target.stat()), "remote": version}
                filled.files += 1
                filled.bytes += int(entry.get("size") or 0)
            for relative in sorted(set(local) - set(remote)):
                (self.local / relative).unlink(missing_ok=True)
                filled.removed += 1
            for relative in set(state) - set(remote):
                del state[relative]
            _remove_empty_directories(self.local)
        finally:
            self._save_state(state)
            shutil.rmtree(self._staging, ignore_errors=True)
        return filled

    # -- while the script runs, and after ----------------------------------------------------------

    def upload(self, final: bool = False) -> Synced:
        """One pass: upload the settled changes (every change when `final`), delete what the script deleted."""
        began = time.monotonic()
        with self._locked():
            uploaded = self._upload(final)
        uploaded.seconds = time.monotonic() - began
        return uploaded

    def _upload(self, final: bool) -> Synced:
        fs, root = self._fs()
        state = self._load_state()
        local = self._local_files()
        changed = {
            relative: status
            for relative, status in local.items()
            if state.get(relative, {}).get("local") != _stat_key(status)
        }
        newest: dict[str, int] = {}  # each top-level entry's last write
        for relative, status in local.items():
            top = relative.split("/", 1)[0]
            newest[top] = max(newest.get(top, 0), status.st_mtime_ns)
        settled_before = int((self._clock() - self._settle_s) * 1e9)
        ready = [relative for relative in changed if final or newest[relative.split("/", 1)[0]] <= settled_before]
        uploaded = Synced(waiting=len(changed) - len(ready))
        needs_directories = not set(_protocols(fs)) & _OBJECT_STORES
        made: set[str] = set()
        try:
            for relative in sorted(ready, key=lambda name: (changed[name].st_mtime_ns, name)):
                path, target = self.local / relative, f"{root}/{relative}"
                before = changed[relative]
                try:
                    parent = target.rsplit("/", 1)[0]
                    if needs_directories and parent not in made:
                        fs.makedirs(parent, exist_ok=True)
                        made.add(parent)
                    fs.put_file(str(path), target)
                    version = _version(fs.info(target))
                except Exception as failure:
                    if not path.is_file():
                        continue  # deleted meanwhile: the next pass deletes it from the storage
                    uploaded.failed += 1
                    uploaded.error = uploaded.error or f"{relative}: {_describe(failure)}"
                    continue
                try:
                    after = path.stat()
                except FileNotFoundError:
                    continue
                if _stat_key(after) == _stat_key(before):
                    state[relative] = {"local": _stat_key(after), "remote": version}
                    uploaded.files += 1
                    uploaded.bytes += after.st_size
                # else: written again while it was uploaded; a later pass uploads it again
            for relative in sorted(set(state) - set(local)):
                try:
                    fs.rm_file(f"{root}/{relative}")
                except FileNotFoundError:
                    pass
                except Exception as failure:
                    uploaded.failed += 1
                    uploaded.error = uploaded.error or f"deleting {relative}: {_describe(failure)}"
                    continue
                del state[relative]
                uploaded.removed += 1
        finally:
            self._save_state(state)
        return uploaded

    def follow(self, ended: Callable[[float], bool]) -> None:
        """Upload every `every_s` until `ended(timeout)` (the script's process waited for) says the process ended,
        then the final pass; `finished` is set after it. Run in a thread of the worker."""
        try:
            while not ended(self._every_s):
                self._pass(final=False)
            error = None
            for attempt in range(FINAL_TRIES):
                result, error = self._pass(final=True)
                if error is None:
                    if result.files or result.removed:
                        deleted = f", {result.removed} deleted there" if result.removed else ""
                        self.note(
                            logging.INFO,
                            f"after the script's end, {_count(result.files)} ({_size(result.bytes)}) uploaded to "
                            f"{self.remote_uri}{deleted}",
                        )
                    return
                if attempt + 1 < FINAL_TRIES:
                    time.sleep(self._retry_wait_s * 2**attempt)
            self.note(
                logging.WARNING,
                f"the final upload of RINGMASTER_CHECKPOINT_DIR to {self.remote_uri} failed ({error}): what the "
                f"script wrote last is only in {self.local} on this node",
            )
        finally:
            self.finished.set()

    def _pass(self, final: bool) -> tuple[Synced, str | None]:
        """One upload pass, and its failure in one line (None: it succeeded); never an exception. A failure while
        the script runs is said once, until a pass succeeds again."""
        error: str | None
        try:
            result = self.upload(final)
        except Exception as failure:
            result, error = Synced(), _describe(failure)
        else:
            error = result.error
        if error is not None and not self._failing and not final:
            what = f"{_count(result.failed)} of " if result.failed else ""
            self.note(
                logging.WARNING,
                f"uploading {what}RINGMASTER_CHECKPOINT_DIR to {self.remote_uri} failed, retried every "
                f"{self._every_s:g} s: {error}",
            )
        elif error is None and self._failing:
            self.note(logging.INFO, f"uploads of RINGMASTER_CHECKPOINT_DIR to {self.remote_uri} work again")
        self._failing = error is not None
        return result, error

    def note(self, level: int, text: str) -> None:
        log.log(level, text)
        with self._notes_lock:
            self._notes.append((level, text))

    def drain_notes(self) -> list[Note]:
        """The notes since the last drain, for the driver."""
        with self._notes_lock:
            notes = list(self._notes)
            self._notes.clear()
        return notes

    # -- the node's state --------------------------------------------------------------------------

    def _fs(self) -> tuple[AbstractFileSystem, str]:
        if self._filesystem is None:
            fs, root = fsspec.core.url_to_fs(self.remote_uri)
            self._filesystem = fs, root.rstrip("/")
        return self._filesystem

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self._lock_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock_file, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _load_state(self) -> dict[str, dict[str, Any]]:
        """Each file's version as last synced: {"local": [size, mtime_ns], "remote": the storage's version}."""
        try:
            state = json.loads(self._state_file.read_text())
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def _save_state(self, state: dict[str, dict[str, Any]]) -> None:
        partial = self._state_file.with_name(self._state_file.name + ".partial")
        partial.write_text(json.dumps(state))
        os.replace(partial, self._state_file)

    def _local_files(self) -> dict[str, os.stat_result]:
        """Every plain file under the directory (links and others are left alone), by its path relative to it."""
        files = {}
        for directory, _, names in os.walk(self.local):
            for name in names:
                path = os.path.join(directory, name)
                try:
                    status = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(status.st_mode):
                    files[Path(path).relative_to(self.local).as_posix()] = status
        return files


def _stat_key(status: os.stat_result) -> list[int]:
    return [status.st_size, status.st_mtime_ns]


def _relative(name: str, root: str) -> str | None:
    prefix = root.rstrip("/") + "/"
    return name[len(prefix) :] if name.startswith(prefix) and len(name) > len(prefix) else None


def _version(entry: dict[str, Any]) -> str:
    """Which version of a file the storage has: its ETag where it gives one, else its size and modification time
    (milliseconds: listings and single looks give them at different precisions)."""
    etag = entry.get("ETag") or entry.get("etag")
    if etag:
        return f"{entry.get('size')}:{str(etag).strip(chr(34))}"
    modified = _timestamp(entry)
    return f"{entry.get('size')}:{'' if modified is None else round(modified, 3)}"


def _timestamp(entry: dict[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = entry.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _remove_empty_directories(root: Path) -> None:
    for directory, _, _ in sorted(os.walk(root), key=lambda walked: -len(walked[0])):
        if Path(directory) != root:
            try:
                os.rmdir(directory)
            except OSError:
                pass  # not empty


def _describe(error: BaseException) -> str:
    """An error in one line, its type first (no traceback; a backend's message names no credentials)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__


def _count(files: int) -> str:
    return f"{files} file" + ("" if files == 1 else "s")


def _size(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size} bytes"
