"""Ending a process tree, all of it (Linux, from /proc): what a process started, what those started, and so on.

A tree is found again at every look, so a process started while it stops (a Ray worker the raylet starts late) is
ended too. Parent links alone miss what Ray moves out of reach: each Ray worker sits in a process group of its own and
each job driver in a session of its own, and a process whose parent dies is handed to init. So a tree also holds
every process of a session that one of its members leads: a session's id is never handed to another process while
any process of it lives. Each pid is remembered with its start time, so a pid the kernel has since reused is never
signalled.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

_POLL_S = 0.1
# A frozen process starts nothing new; a few rounds of freezing what the last look found settle any tree.
_FREEZE_ROUNDS = 20


@dataclass(frozen=True)
class _Process:
    parent: int
    session: int
    started: int  # clock ticks after boot: with the pid, names one process for good
    exited: bool  # a zombie, or on its way out


def _read(pid: int) -> _Process | None:
    try:
        # The command name (field 2) may hold spaces and parentheses: the fields after its last ")" are fixed.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return _Process(
            parent=int(fields[1]), session=int(fields[3]), started=int(fields[19]), exited=fields[0] in "ZX"
        )
    except (OSError, IndexError, ValueError):
        return None


def process_started_at(pid: int) -> int | None:
    """When the live process `pid` started (clock ticks after boot), to tell it from a later one with its pid; None
    when there is none."""
    found = _read(pid)
    return None if found is None or found.exited else found.started


def _snapshot() -> dict[int, _Process]:
    processes = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (found := _read(int(entry))) is not None:
            processes[int(entry)] = found
    return processes


class ProcessTree:
    """The processes below `root` (and `root` itself when `include_root`), plus those of `sessions`: the sessions of a
    tree whose root is gone already, whose members no parent link reaches."""

    def __init__(self, root: int | None, *, include_root: bool = True, sessions: Iterable[int] = ()) -> None:
        self._root = root
        self._root_started = process_started_at(root) if root is not None else None
        self._sessions = set(sessions)
        self.members: dict[int, int] = {}  # pid -> its start time
        if root is not None and include_root and self._root_started is not None:
            self.members[root] = self._root_started
        self.look()

    def look(self) -> set[int]:
        """Add what the tree has started since the last look; the members alive now."""
        processes = _snapshot()

        def same(pid: int, started: int | None) -> bool:
            found = processes.get(pid)
            return found is not None and found.started == started and not found.exited

        alive = {pid for pid, started in self.members.items() if same(pid, started)}
        children: dict[int, list[int]] = {}
        for pid, found in processes.items():
            children.setdefault(found.parent, []).append(pid)
        root = self._root if self._root is not None and same(self._root, self._root_started) else None
        frontier = [*alive, *([root] if root is not None else [])]
        while frontier:
            while frontier:
                for child in children.get(frontier.pop(), []):
                    if child not in alive and not processes[child].exited:
                        alive.add(child)
                        frontier.append(child)
            self._sessions.update(pid for pid in alive if processes[pid].session == pid)  # it leads one
            frontier = [
                pid
                for pid, found in processes.items()
                if found.session in self._sessions and pid not in alive and pid != root and not found.exited
            ]
            alive.update(frontier)
        for pid in alive:
            self.members.setdefault(pid, processes[pid].started)
        return alive

    @staticmethod
    def send(signum: int, pids: Iterable[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def end(self, grace_s: float, terminate: Callable[[], None] | None = None) -> None:
        """Ask the tree to stop (`terminate`; by default SIGTERM to every member), wait up to grace_s for it to, then
        freeze what is left and kill it."""
        alive = self.look()
        if terminate is not None:
            terminate()
        else:
            self.send(signal.SIGTERM, alive)
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            self._reap()
            alive = self.look()
        frozen: set[int] = set()
        for _ in range(_FREEZE_ROUNDS):
            if not (alive := self.look()) - frozen:
                break
            self.send(signal.SIGSTOP, alive - frozen)
            frozen |= alive
        self.send(signal.SIGKILL, alive)
        deadline = time.monotonic() + 5.0  # SIGKILL cannot be refused: this only waits for the kernel
        while alive and time.monotonic() < deadline:
            time.sleep(0.02)
            self._reap()
            alive = {pid for pid in alive if process_started_at(pid) == self.members[pid]}
        self._reap()

    def _reap(self) -> None:
        """Collect the exit of the members that are this process's children, so none is left a zombie."""
        for pid, started in self.members.items():
            found = _read(pid)
            if found is not None and found.started == started and found.exited:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
