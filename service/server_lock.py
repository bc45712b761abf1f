"""One server per data directory: the lock a running `ringmaster serve` holds on its pid file, for as long as it runs.

The kernel releases the lock when the server's process ends, however it ends (kill -9 too), so a held lock means a
live server and its pid is the file's content: `ringmaster stop` signals that pid, and a second `serve` on the same
directory is refused (two would share one embedded Ray head, and the data directory's api-url names one of them).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


class DataDirInUse(RuntimeError):
    """Another server runs on this data directory."""


class ServerLock:
    """The lock this process holds on `path` while it serves."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited: the head's processes never hold it
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            pid = running_server(path)
            raise DataDirInUse(
                f"a ringmaster server already runs on {path.parent.resolve()}"
                + (f" (pid {pid})" if pid is not None else "")
                + "; `ringmaster stop` ends it, or set RINGMASTER_DATA_DIR to another directory for this one"
            ) from None
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()}\n".encode())
        self._descriptor: int | None = descriptor

    def __enter__(self) -> ServerLock:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()

    def release(self) -> None:
        if self._descriptor is None:
            return
        self.path.unlink(missing_ok=True)  # before the lock goes: a new server then makes a file of its own
        os.close(self._descriptor)
        self._descriptor = None


def running_server(path: Path, settle_s: float = 1.0) -> int | None:
    """The pid of the server that holds the lock on `path`; None when no server runs there."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return None  # nobody holds it: the server that wrote it is gone
            except BlockingIOError:
                pass
            content = os.read(descriptor, 32).decode(errors="replace").strip()
        finally:
            os.close(descriptor)
        if content.isdigit():
            return int(content)
        if time.monotonic() > deadline:  # locked, and still no pid: not a file ServerLock wrote
            return None
        time.sleep(0.05)  # locked a moment ago, its pid not written yet
