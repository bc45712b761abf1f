"""One run of a script's command on one rank: started once as a process of its own, its output kept line by line
for the driver, stopped as torchrun stops it (SIGTERM to its process group, a grace, then SIGKILL).

The process dies with its worker: the kernel sends it SIGKILL when the thread that started it ends (prctl's
parent-death signal), and that thread lives until the process has exited.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import IO, Any

STDERR_TAIL_LINES = 20  # what a failure's message quotes of the rank's stderr
_MAX_BUFFERED_LINES = 20_000  # output not yet handed to the driver; older lines are dropped beyond it
_MAX_LINE_BYTES = 64 * 1024  # a longer line (a progress bar's \r-joined updates) is cut into pieces of this size
_PR_SET_PDEATHSIG = 1
# The exit code a shell gives a command it cannot find, or cannot run.
NOT_FOUND_EXIT_CODE = 127
NOT_RUNNABLE_EXIT_CODE = 126


@dataclass(frozen=True)
class Exit:
    """How the process ended: its code (negative: killed by that signal), when, and whether a stop asked it to."""

    code: int
    at: float  # time.time()
    stopped: bool
    start_error: str | None = None  # the command could not start at all: why

    def as_dict(self) -> dict[str, Any]:
        """What the driver receives: the fields, and the description."""
        return {**asdict(self), "description": self.describe()}

    def describe(self) -> str:
        if self.start_error is not None:
            return self.start_error
        if self.code < 0:
            return f"was killed by {signal.Signals(-self.code).name}"
        return f"exited with code {self.code}"


def _die_with_starting_thread() -> None:
    """In the child, before exec: a session of its own (so a stop reaches its children), and SIGKILL when the
    thread that started it ends."""
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ScriptProcess:
    def __init__(self, command: list[str], environment: dict[str, str], cwd: str) -> None:
        self._command, self._environment, self._cwd = command, environment, cwd
        self._lock = threading.Lock()
        self._lines: deque[tuple[str, str]] = deque()  # (stream, line) not yet drained
        self._dropped = 0
        self._stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._process: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self.exit: Exit | None = None
        self._started = threading.Event()
        self._ended = threading.Event()

    @property
    def pid(self) -> int:
        return self._process.pid if self._process is not None else 0

    def start(self) -> None:
        """Start the command; returns once it runs or could not start (then `exit` says why)."""
        threading.Thread(target=self._run, name="script-process", daemon=True).start()
        self._started.wait()

    def _run(self) -> None:
        try:
            self._process = subprocess.Popen(
                self._command,
                env=self._environment,
                cwd=self._cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=_die_with_starting_thread,  # this thread does nothing else meanwhile
            )
        except OSError as error:
            code = NOT_FOUND_EXIT_CODE if isinstance(error, FileNotFoundError) else NOT_RUNNABLE_EXIT_CODE
            why = error.strerror or str(error)
            self.exit = Exit(code, time.time(), False, f"could not start {self._command[0]!r}: {why}")
            self._started.set()
            self._ended.set()
            return
        self._started.set()
        assert self._process.stdout is not None and self._process.stderr is not None  # both are pipes
        errors = threading.Thread(target=self._pump, args=(self._process.stderr, "stderr"), daemon=True)
        errors.start()
        self._pump(self._process.stdout, "stdout")
        errors.join()
        code = self._process.wait()
        with self._lock:
            self.exit = Exit(code, time.time(), self._stopping)
        self._ended.set()

    def _pump(self, stream: IO[bytes], name: str) -> None:
        for raw in iter(lambda: stream.readline(_MAX_LINE_BYTES), b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with self._lock:
                if len(self._lines) >= _MAX_BUFFERED_LINES:
                    self._lines.popleft()
                    self._dropped += 1
                self._lines.append((name, line))
                if name == "stderr":
                    self._stderr_tail.append(line)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether the process has ended (or could not start), waiting up to `timeout_s` for it."""
        return self._ended.wait(timeout_s)

    def drain(self) -> tuple[list[tuple[str, str]], int]:
        """The output lines since the last drain, and how many were dropped meanwhile (too many to buffer)."""
        with self._lock:
            lines, dropped = list(self._lines), self._dropped
            self._lines.clear()
            self._dropped = 0
        return lines, dropped

    @property
    def stderr_tail(self) -> list[str]:
        with self._lock:
            return list(self._stderr_tail)

    def stop(self, grace_s: float) -> Exit | None:
        """SIGTERM to the process and its children, SIGKILL after `grace_s` if they are still there; returns how it
        ended (None: it could not be ended, which only a process stuck in the kernel does)."""
        with self._lock:
            self._stopping = True
        process = self._process
        if process is not None and self.exit is None:
            self._signal(process, signal.SIGTERM)
            if not self._ended.wait(grace_s):
                self._signal(process, signal.SIGKILL)
        self._ended.wait(grace_s + 5)
        return self.exit

    @staticmethod
    def _signal(process: subprocess.Popen[bytes], signum: signal.Signals) -> None:
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            pass
