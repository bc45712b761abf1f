"""A node's fork server for training processes: it imports torch and the training stack once, and forks each worker
actor's training process from itself, instead of every training process importing them afresh (about 2.5 CPU-seconds
each, on the path from a worker's start to its first step).

One server per Ray node (its raylet) and per import context: the interpreter, where `ringmaster` and `torch` are
found, the actor's PYTHONPATH and the variables torch reads while it imports. It imports from those alone (not from
a job's own code), so the jobs of one context share it; an actor whose context no server has yet starts one, and two
actors starting at once agree through a lock file. A job whose own import path (Ray's working_dir, py_modules or pip
env) holds a top-level module the server has imported (its own torch, say) is refused, and its actor starts the
process afresh. The server lives while its raylet lives (a node that is lost loses its server) and ends after
`IDLE_EXIT_S` with no training process and no request.

Each training process gets its actor's environment, working directory, import path, stdout and stderr, so it runs
as if its actor had started it, and the two stay one failure unit (workers/rank_process.py): the server kills it the
moment its actor's request connection closes (the actor died), and it ends by itself when its connection to the actor
ends or the actor's process does (a thread watches it).

The server imports in its only thread and forks from it: a fork copies the memory of threads that no longer run, and
a thread that had ended but not yet released a lock (one a native library takes without a fork handler) would leave
that lock held for ever in the child.
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
_MODULE_SUFFIXES = (".py", ".pyc", ".so", ".pyd")
_REFUSED = -1  # the server's answer instead of a pid: start the process afresh


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


def fork_rank_process(connection_fd: int) -> ForkedRankProcess | None:
    """Have this node's fork server fork the training process that serves the actor on `connection_fd`, or None
    where none can (the caller then starts one afresh)."""
    raylet_pid = _raylet_pid()
    folder = _private_socket_folder()
    if raylet_pid is None or folder is None:
        return None
    path = folder / f"rank-forkserver-{raylet_pid}-{_import_context_key()}.sock"
    return request_fork(path, raylet_pid, connection_fd)


def request_fork(path: Path, raylet_pid: int, connection_fd: int) -> ForkedRankProcess | None:
    """Ask the server on `path` (started here if none serves there, to live as long as `raylet_pid`) for a training
    process with this process's environment, directory, import path, stdout and stderr; None where it cannot."""
    if _refusal(path).exists():
        return None
    request = pickle.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "sys_path": list(sys.path)})
    try:
        channel = _connect_or_start(path, raylet_pid)
        socket.send_fds(channel, [_LENGTH.pack(len(request))], [connection_fd, 1, 2])
        channel.sendall(request)
        pid: int = _CODE.unpack(_receive_exactly(channel, _CODE.size))[0]
    except (OSError, EOFError) as error:
        log.warning("no fork server for the training process (%s); starting it afresh", error)
        return None
    if pid == _REFUSED:  # the job's own import path shadows a module the server imported
        channel.close()
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
    PYTHONPATH it imports from and the variables torch reads on import. (The rest of a job's import path is checked
    at each request: shadowed_modules.)"""
    import ringmaster

    torch_spec = importlib.util.find_spec("torch")
    context = [
        sys.executable,
        ringmaster.__file__,
        torch_spec.origin if torch_spec else None,
        os.environ.get("PYTHONPATH"),
        sorted((name, value) for name, value in os.environ.items() if name.startswith(_IMPORT_TIME_PREFIXES)),
    ]
    return hashlib.sha256(repr(context).encode()).hexdigest()[:16]


def imported_locations() -> dict[str, set[str]]:
    """Each top-level module this process imported from a file, with where it lives (a package's folders, else its
    file), resolved: what a job's import path must not hold another copy of."""
    locations: dict[str, set[str]] = {}
    for name, module in list(sys.modules.items()):
        if "." in name or module is None:
            continue
        places = list(getattr(module, "__path__", None) or [])
        if not places and getattr(module, "__file__", None):
            places = [module.__file__]
        if places:
            locations[name] = {os.path.realpath(place) for place in places}
    return locations


def shadowed_modules(
    import_path: list[str], own_path: list[str], imported: dict[str, set[str]], ignored: tuple[str, ...] = ()
) -> set[str]:
    """The modules of `imported` (imported_locations) of which an entry of `import_path` not in `own_path` (nor
    below a folder of `ignored`) holds another copy: a process forked with that path would keep the server's. An
    entry that is no readable folder (a zip of py_modules) might hold any, so it counts as shadowing them all."""
    shadowed: set[str] = set()
    for entry in import_path:
        if not entry or entry in own_path or os.path.realpath(entry).startswith(ignored):
            continue
        try:
            names = os.listdir(entry)
        except OSError:
            if os.path.exists(entry):
                return set(imported)
            continue
        for name in names:
            place = os.path.join(entry, name)
            top, dot, _ = name.partition(".")
            importable = name.endswith(_MODULE_SUFFIXES) if dot else os.path.isdir(place)
            if not importable:
                continue  # not importable: metadata (.dist-info, .pth), data
            if top in imported and os.path.realpath(place) not in imported[top]:
                shadowed.add(top)
    return shadowed


def _ray_folders() -> tuple[str, ...]:
    """Ray's own folders, which Ray puts on its workers' import path for what it vendors (colorama, psutil): copies
    for Ray's use, not the job's."""
    spec = importlib.util.find_spec("ray")
    return (os.path.realpath(os.path.dirname(spec.origin)) + os.sep,) if spec and spec.origin else ()


def _connect(path: Path) -> socket.socket:
    channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        channel.connect(str(path))
    except OSError:
        channel.close()
        raise
    return channel


def _connect_or_start(path: Path, raylet_pid: int) -> socket.socket:
    with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
        return _connect(path)
    with open(_lock(path), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one actor starts the server; the others wait here, then connect
        with contextlib.suppress(FileNotFoundError, ConnectionRefusedError):
            return _connect(path)
        path.unlink(missing_ok=True)  # a server that ended (its raylet's pid reused) left it
        # The server imports from the actor's PYTHONPATH and the interpreter's own paths alone: not from the job's
        # code (Ray's working_dir is the actor's directory; -P: nor from the directory it starts in).
        import ringmaster

        command = [sys.executable, "-P", "-m", "ringmaster.workers.rank_forkserver", str(path), str(raylet_pid)]
        server = subprocess.Popen(
            [*command, ringmaster.__file__],
            env=dict(os.environ),
            cwd=path.parent,
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
        self._imported: dict[str, set[str]] = {}  # the top-level modules imported before serving, and where from

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
        shadowed = shadowed_modules(request["sys_path"], sys.path, self._imported, _ray_folders())
        if shadowed:
            log.info("not forking for a job whose import path has its own %s", ", ".join(sorted(shadowed)[:5]))
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                channel.sendall(_CODE.pack(_REFUSED))
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


def serve(path: Path, raylet_pid: int, ringmaster_file: str) -> None:
    """Listen on `path` (before importing: actors connect and wait meanwhile), import the training stack, then serve
    while raylet `raylet_pid` lives; where what it imported is not what the actor that started it imports (another
    ringmaster than `ringmaster_file`), or touched the CUDA driver, leave a refusal instead."""
    os.umask(0o077)
    try:
        raylet_exit_fd = os.pidfd_open(raylet_pid)
    except OSError as error:  # the raylet is gone already, or the kernel has no pidfd (Linux < 5.3)
        log.warning("fork server not serving: cannot watch raylet %d (%s)", raylet_pid, error)
        return
    server = _Server(path, raylet_exit_fd)
    why_not = _preload(ringmaster_file)
    if why_not:
        log.warning("fork server not serving: %s", why_not)
        _refusal(path).touch()
        return
    server._imported = imported_locations()
    server.run()


def _preload(ringmaster_file: str) -> str | None:
    """Import the training stack, in this process's only thread; why it may not serve, else None."""
    import torch

    # No intra-op thread pool here: a forked child cannot use one its parent started (join sets the child's).
    torch.set_num_threads(1)
    import ringmaster
    from ringmaster.workers import rank_process, torch_internals

    if ringmaster.__file__ != ringmaster_file:
        return f"it imports ringmaster from {ringmaster.__file__}, its actor from {ringmaster_file}"
    with torch_internals.cuda_driver_queries() as made:
        rank_process.import_training_stack(every_optimizer=True)
    if made:
        return "importing the training stack queried the CUDA driver, which a forked process cannot use"
    return None


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
    path, raylet_pid, ringmaster_file = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    try:
        serve(path, raylet_pid, ringmaster_file)
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
