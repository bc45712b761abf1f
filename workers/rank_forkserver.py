"""A node's fork server for training processes: it imports torch and the training stack once, and forks each worker
actor's training process from itself, instead of every training process importing them afresh (about 3 CPU-seconds
each, on the path from a worker's start to its first step).

One server per Ray node (its raylet) and per import context: the interpreter, where `ringmaster` and `torch` are
found, the actor's import path and the variables torch reads while it imports. An actor whose context no server has
yet starts one; two actors starting at once agree through a lock file. The server lives while its raylet lives (a node
that is lost loses its server) and ends after `IDLE_EXIT_S` with no training process and no request, so a job with
code of its own leaves no server behind.

Each training process gets its actor's environment, working directory, import path, stdout and stderr, so it runs
as if its actor had started it, and the two stay one failure unit (workers/rank_process.py): the server kills it the
moment its actor's request connection closes (the actor died), and it ends by itself when its connection to the actor
ends or the actor's process does (a thread watches it).
Where no server can serve (no raylet is the actor's parent, the socket folder is not private, the server cannot
start, or importing the training stack touched the CUDA driver, which a forked child cannot use), the actor starts
its training process afresh, as before: `fork_rank_process` returns None.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import pickle
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("ringmaster.rank_forkserver")

IDLE_EXIT_S = 120.0
_START_TIMEOUT_S = 60.0
# Variables torch or the dynamic loader read while torch imports: a server imported with other values serves nobody
# else. Those read later (CUDA_VISIBLE_DEVICES, NCCL_*, OMP_NUM_THREADS, which set_num_threads overrides) are set in
# each training process before it uses them.
_IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "LD_PRELOAD", "LD_LIBRARY_PATH")
_LENGTH = struct.Struct("!Q")
_CODE = struct.Struct("!i")


class ForkedRankProcess:
    """The actor's handle on a training process the server forked: its pid, and `wait` for its end."""

    def __init__(self, channel: socket.socket, pid: int) -> None:
        self._channel = channel  # open for the process's life: the server kills the process when it closes
        self.pid = pid

    def wait(self) -> int | None:
        """Block until the process ends; its exit code (negative: the signal that ended it), or None where the
        server ended first (its node is going away)."""
        try:
            code: int = _CODE.unpack(_receive_exactly(self._channel, _CODE.size))[0]
            return code
        except (EOFError, OSError):
            return None
        finally:
            self._channel.close()


def fork_rank_process(connection_fd: int, pooled: bool) -> ForkedRankProcess | None:
    """Have this node's fork server fork the training process that serves the actor on `connection_fd`, or None
    where none can (the caller then starts one afresh)."""
    raylet_pid = _raylet_pid()
    folder = _private_socket_folder()
    if raylet_pid is None or folder is None:
        return None
    path = folder / f"rank-forkserver-{raylet_pid}-{_import_context_key()}.sock"
    return request_fork(path, raylet_pid, connection_fd, pooled)


def request_fork(path: Path, raylet_pid: int, connection_fd: int, pooled: bool) -> ForkedRankProcess | None:
    """Ask the server on `path` (started here if none serves there, to live as long as `raylet_pid`) for a training
    process with this process's environment, directory, import path, stdout and stderr; None where it cannot."""
    if _refusal(path).exists():
        return None
    request = pickle.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "sys_path": list(sys.path)})
    try:
        channel = _connect_or_start(path, raylet_pid, pooled)
        socket.send_fds(channel, [_LENGTH.pack(len(request))], [connection_fd, 1, 2])
        channel.sendall(request)
        pid: int = _CODE.unpack(_receive_exactly(channel, _CODE.size))[0]
    except (OSError, EOFError) as error:
        log.warning("no fork server for the training process (%s); starting it afresh", error)
        return None
    return ForkedRankProcess(channel, pid)


def _lock(path: Path) -> Path:
    return path.with_suffix(".lock")


def _refusal(path: Path) -> Path:
    """Left by a server that found it cannot serve its context, so that no actor starts another to find the same."""
    return path.with_suffix(".refused")


def _raylet_pid() -> int | None:
    """The raylet that started this actor's process (its parent), which the node's server lives as long as."""
    parent = os.getppid()
    try:
        return parent if Path(f"/proc/{parent}/comm").read_text().strip() == "raylet" else None
    except OSError:
        return None


def _private_socket_folder() -> Path | None:
    """A folder only this user can enter, for the servers' sockets (anyone who can connect can run code as us)."""
    folder = Path(tempfile.gettempdir(), f"ringmaster-{os.getuid()}")
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        status = folder.stat()
    except OSError:
        return None
    return folder if status.st_uid == os.getuid() and status.st_mode & 0o077 == 0 else None


def _import_context_key() -> str:
    """What a server imported with must equal the actor's: the interpreter, where ringmaster and torch come from, the
    import path (a job's own code may shadow a module the server imported) and the variables torch reads on import."""
    import ringmaster

    torch_spec = importlib.util.find_spec("torch")
    context = [
        sys.executable,
        ringmaster.__file__,
        torch_spec.origin if torch_spec else None,
        sys.path,
        sorted((name, value) for name, value in os.environ.items() if name.startswith(_IMPORT_TIME_PREFIXES)),
    ]
    return hashlib.sha256(repr(context).encode()).hexdigest()[:16]


def _connect(path: Path) -> socket.socket:
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        channel.connect(str(path))
    except OSError:
        channel.close()
        raise
    return channel


def _connect_or_start(path: Path, raylet_pid: int, pooled: bool) -> socket.socket:
    with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
        return _connect(path)
    with open(_lock(path), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one actor starts the server; the others wait here, then connect
        with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
            return _connect(path)
        path.unlink(missing_ok=True)  # a server that ended (its raylet's pid reused) left it
        # The server imports from where the actor does, in the same order (-P: nothing put before them).
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(entry for entry in sys.path if entry)}
        command = [sys.executable, "-P", "-m", "ringmaster.workers.rank_forkserver", str(path), str(raylet_pid)]
        server = subprocess.Popen(
            command + (["--pooled"] if pooled else []),
            env=environment,
            cwd=os.getcwd(),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # not in the actor's process group: it outlives the actor that started it
        )
        threading.Thread(target=server.wait, name="fork-server-reaper", daemon=True).start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:  # it listens before it imports: a connection waits in its backlog until it serves
            with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
                return _connect(path)
            if server.poll() is not None or time.monotonic() > deadline:
                raise TimeoutError(f"the fork server {path.name} did not start")
            time.sleep(0.02)


def _receive_exactly(channel: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = channel.recv(size - len(data))
        if not chunk:
            raise EOFError("the connection ended")
        data += chunk
    return data


# -- the server ------------------------------------------------------------------------------------------------------


class _Child:
    def __init__(self, pid: int, channel: socket.socket) -> None:
        self.pid, self.channel, self.exit_fd = pid, channel, os.pidfd_open(pid)


class _Server:
    """Forks a training process for each request until its raylet ends or nothing was asked for `IDLE_EXIT_S`."""

    def __init__(self, path: Path, raylet_exit_fd: int) -> None:
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._path = path
        self._listener.bind(str(path))
        self._listener.listen(64)
        self._raylet_exit_fd = raylet_exit_fd
        self._selector = selectors.DefaultSelector()
        self._children: dict[int, _Child] = {}  # by pid

    def run(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ, "request")
        self._selector.register(self._raylet_exit_fd, selectors.EVENT_READ, "raylet")
        idle_since = time.monotonic()
        while self._children or time.monotonic() - idle_since < IDLE_EXIT_S:
            for key, _ in self._selector.select(timeout=IDLE_EXIT_S / 4):
                if key.data == "raylet":  # the node is going: so is every training process on it
                    for child in self._children.values():
                        _kill(child.pid)
                    # No actor of this raylet can ask for the lock again (an idle server leaves it: one may be waiting).
                    _lock(self._path).unlink(missing_ok=True)
                    return
                if key.data == "request":
                    self._fork_requested(self._listener.accept()[0])
                elif key.data[0] == "actor":
                    self._actor_spoke(key.data[1])
                else:
                    self._reap(key.data[1])
                    idle_since = time.monotonic()

    def _actor_spoke(self, child: _Child) -> None:
        """The actor never writes to its request: readable means it closed, because it died. Its process goes too."""
        with contextlib.suppress(OSError):
            if child.channel.recv(1):
                return
        self._selector.unregister(child.channel)
        _kill(child.pid)

    def _reap(self, child: _Child) -> None:
        code = os.waitstatus_to_exitcode(os.waitpid(child.pid, 0)[1])
        with contextlib.suppress(OSError):
            child.channel.sendall(_CODE.pack(code))
        self._selector.unregister(child.exit_fd)
        with contextlib.suppress(KeyError):
            self._selector.unregister(child.channel)
        os.close(child.exit_fd)
        child.channel.close()
        del self._children[child.pid]

    def _fork_requested(self, channel: socket.socket) -> None:
        try:
            header, fds, _, _ = socket.recv_fds(channel, _LENGTH.size, 3)
            if len(header) != _LENGTH.size or len(fds) != 3:
                raise EOFError("an incomplete request")
            request = pickle.loads(_receive_exactly(channel, _LENGTH.unpack(header)[0]))
        except (OSError, EOFError, pickle.UnpicklingError) as error:
            log.warning("a request for a training process failed: %s", error)
            channel.close()
            return
        # The requesting actor's process, as the kernel knows it (struct ucred: pid, uid, gid).
        actor_pid = struct.unpack("3i", channel.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                self._close_in_child()
                _become_training_process(request, actor_pid, *fds)
            finally:
                os._exit(1)
        for fd in fds:  # the child's now: the actor sees its connection end when the child's copy closes
            os.close(fd)
        child = _Child(pid, channel)
        self._children[pid] = child
        with contextlib.suppress(OSError):  # an actor already gone: its closed request kills the child below
            channel.sendall(_CODE.pack(pid))
        self._selector.register(channel, selectors.EVENT_READ, ("actor", child))
        self._selector.register(child.exit_fd, selectors.EVENT_READ, ("exit", child))

    def _close_in_child(self) -> None:
        """A training process holds nothing of the server's: another actor's request, held open here, would hide
        that actor's end from the server."""
        self._selector.close()
        self._listener.close()
        os.close(self._raylet_exit_fd)
        for child in self._children.values():
            child.channel.close()
            os.close(child.exit_fd)


def serve(path: Path, raylet_pid: int, pooled: bool) -> None:
    """Listen on `path` (before importing: actors connect and wait meanwhile), import the training stack, then serve
    while raylet `raylet_pid` lives."""
    os.umask(0o077)
    try:
        raylet_exit_fd = os.pidfd_open(raylet_pid)
    except OSError as error:  # the raylet is gone already, or the kernel has no pidfd (Linux < 5.3)
        log.warning("fork server not serving: cannot watch raylet %d (%s)", raylet_pid, error)
        return
    server = _Server(path, raylet_exit_fd)
    if _preload(pooled):
        server.run()
    else:
        _refusal(path).touch()


def _preload(pooled: bool) -> bool:
    """Import the training stack (at the lowest CPU priority for a warm pool's server, in a thread of its own so the
    forked processes keep normal priority); False where it queried the CUDA driver, which a forked child then cannot
    use."""
    queries: list[None] = []

    def imports() -> None:
        if pooled:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        import torch

        # No intra-op thread pool here: a forked child cannot use one its parent started (join sets the child's).
        torch.set_num_threads(1)
        from ringmaster.workers import rank_process, torch_internals

        with torch_internals.cuda_driver_queries() as made:
            rank_process.import_training_stack(every_optimizer=True)
        queries.extend(made)

    importer = threading.Thread(target=imports, name="preload")
    importer.start()
    importer.join()  # one thread again before the first fork
    if queries:
        log.warning("fork server not serving: importing the training stack queried the CUDA driver")
        return False
    return True


def _become_training_process(
    request: dict[str, Any], actor_pid: int, connection_fd: int, stdout_fd: int, stderr_fd: int
) -> None:
    """In the forked child: end with the actor (as well as when the server kills it), take the actor's stdout,
    stderr, directory, environment and import path, then serve the actor's calls (serve_calls never returns)."""
    from ringmaster.workers import rank_process

    rank_process.die_with_parent(os.getppid())  # the server ends only with its node
    actor_exit_fd = os.pidfd_open(actor_pid)
    threading.Thread(target=_exit_when_readable, args=(actor_exit_fd,), name="actor-watch", daemon=True).start()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, signal.SIG_DFL)
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    os.close(stdout_fd)
    os.close(stderr_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = request["sys_path"]
    rank_process.serve_calls(connection_fd, pooled=False)


def _exit_when_readable(fd: int) -> None:
    """Wait (without the GIL) until `fd`, the actor's pidfd, says the actor ended; then end this process at once."""
    select.select([fd], [], [])
    os._exit(1)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path, raylet_pid, pooled = Path(sys.argv[1]), int(sys.argv[2]), "--pooled" in sys.argv[3:]
    try:
        serve(path, raylet_pid, pooled)
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
