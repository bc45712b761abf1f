"""A worker's training process: the TrainWorker actor starts it and hands it every call that touches torch.

Why a process of its own: a Ray worker process runs Ray's threads beside the training thread, and its main thread
takes the GIL every 10 ms to check for signals (Ray's task loop). Where training fills every core, that thread often
holds the GIL while it waits for a core, and the training thread waits behind it. In a plain child process the
training thread shares its GIL with nothing of Ray's, as a torchrun rank does (bench/overhead.py measures both).

The actor and its process are one failure unit. The process dies with the actor: the kernel sends it SIGKILL when
the thread that started it ends (prctl's parent-death signal; that thread lives as long as the actor's process), and
it exits when its connection ends. The actor dies with the process: when the connection ends, the actor's process
exits, so the driver sees a lost worker as it did when training ran in the actor.

Calls are served concurrently, each in a thread of its own, as the threaded actor serves them: `join` aborts the
group that a `train` stuck in a collective still holds.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from concurrent.futures import Future
from dataclasses import asdict
from datetime import timedelta
from multiprocessing.connection import Connection
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from ringmaster.service.reports import CheckpointRecord, MetricPoint, RankMemory
    from ringmaster.workers.checkpoint.snapshots.store import SnapshotStore

log = logging.getLogger("ringmaster.rank_process")

_PR_SET_PDEATHSIG = 1
# Heads the training process's traceback, a note on the exception the actor raises (policies.describe_task_error),
# with where it ran: "Raised in the worker's training process (rank 1 of 2, pid 4567):".
TRAINING_PROCESS_NOTE = "Raised in the worker's training process"
# The actor's PYTHONPATH, while the process starts with the actor's whole import path as its PYTHONPATH.
_ACTOR_PYTHONPATH = "RINGMASTER_ACTOR_PYTHONPATH"


class RankProcess:
    """The actor's side: starts the training process and calls methods of its `Rank`."""

    def __init__(self, *, pooled: bool) -> None:
        self._pending: dict[int, Future[list[Any]]] = {}  # call id -> the reply after its id
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        # Both set by the thread below before `started` resolves: this constructor returns only once they are.
        self._connection: Connection
        self._process: subprocess.Popen[bytes]
        started: Future[None] = Future()
        # The process's parent-death signal follows the thread that starts it: this one lives as long as the actor.
        threading.Thread(
            target=self._start_and_receive, args=(pooled, started), name="rank-process", daemon=True
        ).start()
        started.result()

    @property
    def pid(self) -> int:
        return self._process.pid

    def call(self, method: str, *args: Any) -> Any:
        """Run `Rank.<method>(*args)` in the training process and return its result, or raise its exception, with
        the training process's traceback as a note (which Ray's account of the failed call prints after it)."""
        future: Future[list[Any]] = Future()
        with self._send_lock:
            call_id = next(self._ids)
            self._pending[call_id] = future
            self._connection.send((call_id, method, args))
        succeeded, payload, text, where = future.result()
        if succeeded:
            return pickle.loads(payload)
        raise raised_error(payload, text, where)

    def _start_and_receive(self, pooled: bool, started: Future[None]) -> None:
        try:
            ours, theirs = socket.socketpair()
            # The actor's import path names the job's code (Ray's working_dir and py_modules): the process imports
            # from the same places in the same order, in the same directory (-P: nothing put before them). Its
            # PYTHONPATH is then the actor's again, which the model registry puts first (the job's own code).
            environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
            if "PYTHONPATH" in os.environ:
                environment[_ACTOR_PYTHONPATH] = os.environ["PYTHONPATH"]
            command = [
                sys.executable,
                "-P",
                "-m",
                "ringmaster.workers.rank_process",
                str(theirs.fileno()),
                str(os.getpid()),
            ]
            self._process = subprocess.Popen(
                command + (["--pooled"] if pooled else []),
                pass_fds=(theirs.fileno(),),
                env=environment,
                cwd=os.getcwd(),
            )
            theirs.close()
            self._connection = Connection(ours.detach())
        except BaseException as error:
            started.set_exception(error)
            return
        started.set_result(None)
        while True:
            try:
                call_id, *reply = self._connection.recv()
            except (EOFError, OSError):
                break
            self._pending.pop(call_id).set_result(reply)
        code = self._process.wait()
        # Without its training process the worker is lost: the actor ends too, so the driver sees what it saw when
        # training ran in the actor and the actor died.
        log.error(
            "the worker's training process (pid %d) ended with code %s; the worker ends with it",
            self._process.pid,
            code,
        )
        os._exit(1)


def raised_error(payload: bytes, text: str, where: str) -> BaseException:
    """The exception the training process raised (`payload`, pickled) with its traceback `text` and `where` it ran
    as a note; one that cannot be rebuilt here (not pickled, or its class not rebuildable from its arguments) becomes
    a RuntimeError of the traceback's last line."""
    error: BaseException
    try:
        error = pickle.loads(payload)
    except Exception:
        error = RuntimeError(text.rstrip().rsplit("\n", 1)[-1])
    error.add_note(f"{TRAINING_PROCESS_NOTE} ({where}):\n{text.rstrip()}")
    return error


class Rank:
    """The training process's side: one rank's process group, training loop, in-memory snapshots and outbox."""

    def __init__(self, pooled: bool) -> None:
        self._outbox = RankOutbox()
        self._snapshots: SnapshotStore | None = None  # this process's in-memory snapshots, made with the training stack
        self._rendezvous: socket.socket | None = None  # where the group this rank leads next meets (rendezvous_port)
        self._group_lock = threading.Lock()
        self._place: tuple[int, int] | None = None  # (rank, world size) in the group it last joined
        self._generation = 0
        # Import the training stack while the driver is still placing and ranking the other workers.
        warm_up = _import_training_stack_in_background if pooled else _import_training_stack
        self._warm = threading.Thread(target=warm_up, name="warm-up", daemon=True)
        self._warm.start()

    def warm_up(self) -> None:
        self._warm.join()

    def whereabouts(self) -> str:
        """ "rank 1 of 2, pid 4567" after the process joined a group; "no group yet, pid 4567" before."""
        if self._place is None:
            return f"no group yet, pid {os.getpid()}"
        return f"rank {self._place[0]} of {self._place[1]}, pid {os.getpid()}"

    def rendezvous_port(self, ip: str) -> int:
        """Open a listening socket on `ip` and a port the system chooses, for the rendezvous store of the group this
        rank will lead as rank 0 (join hands it to the store), and return the port. A port found free and bound only
        later can be taken in between: on a busy node, by another group's connections."""
        listening = socket.socket()
        listening.bind((ip, 0))
        listening.listen()
        if self._rendezvous is not None:
            self._rendezvous.close()
        self._rendezvous = listening
        port: int = listening.getsockname()[1]
        return port

    def resume_step(self, storage_root: str, resume_from_root: str | None) -> int:
        from ringmaster.workers.checkpoint.durable import find_resume_point

        latest = find_resume_point(storage_root)[0]
        if latest is None and resume_from_root is not None:
            latest = find_resume_point(resume_from_root)[0]
        return latest.step if latest is not None else 0

    def snapshot_inventory(self, job_id: str) -> list[dict[str, Any]]:
        return [] if self._snapshots is None else self._snapshots.inventory(job_id)

    def join(
        self,
        cpus: float,
        uses_gpu: bool,
        generation: int,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        timeout_s: float,
        rendezvous_timeout_s: float,
    ) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _abort_process_group

        torch.set_num_threads(max(1, int(cpus)))  # one intra-op thread per CPU granted
        with self._group_lock:
            if dist.is_initialized():
                _abort_process_group()
            self._generation = generation
            self._place = (rank, world_size)
            # The new group's training counts its points from zero. An earlier group's undrained points are replayed
            # from the checkpoint the new group resumes from, which kept them.
            self._outbox = RankOutbox()
            if uses_gpu:
                torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU.
                # A collective a lost peer broke: the watchdog aborts the communicators when it times out, but leaves
                # the process alive (torch's default, 3, ends it), so the survivor keeps its state and its snapshots
                # for the re-formed group. The driver's re-formation aborts them sooner (the join above).
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
            timeout = timedelta(seconds=timeout_s)
            if rank == 0:  # the store serves on the socket rendezvous_port opened, and owns it from now on
                # The driver asks rank 0 for rendezvous_port before join.
                listening, self._rendezvous = cast(socket.socket, self._rendezvous), None
                store = dist.TCPStore(
                    master_addr,
                    master_port,
                    world_size,
                    is_master=True,
                    timeout=timeout,
                    wait_for_workers=False,
                    master_listen_fd=listening.detach(),
                )
            else:
                store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
            # As init_method="tcp://..." would, under the prefix torch gives the default group's keys.
            form_default_group(
                "nccl" if uses_gpu else "gloo",
                dist.PrefixStore("default_pg", store),
                rank,
                world_size,
                rendezvous=timedelta(seconds=min(timeout_s, rendezvous_timeout_s)),
                collectives=timeout,
            )

    def train(
        self,
        uses_gpu: bool,
        generation: int,
        spec_json: str,
        job_id: str,
        storage_root: str,
        ranks_per_node: list[int],
        resume_from_root: str | None,
        attempt: int,
        resume_snapshot: dict[str, int] | None,
    ) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        # The group formed while the warm-up thread imported the rest; training needs all of it.
        self._warm.join()
        from ringmaster.service.spec import JobSpec
        from ringmaster.workers.checkpoint.snapshots.store import SnapshotRef, SnapshotStore
        from ringmaster.workers.trainer import TrainContext, run_training

        if self._snapshots is None:
            self._snapshots = SnapshotStore()
        spec = JobSpec.model_validate_json(spec_json)
        device = torch.device("cuda", 0) if uses_gpu else torch.device("cpu")
        context = TrainContext(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            device=device,
            job_id=job_id,
            storage_root=storage_root,
            sink=self._outbox,
            ranks_per_node=tuple(ranks_per_node),
            generation=generation,
            resume_from_root=resume_from_root,
            attempt=attempt,
            snapshot_store=self._snapshots,
            resume_snapshot=SnapshotRef(**resume_snapshot) if resume_snapshot else None,
        )
        try:
            result = run_training(spec, context)
        finally:
            with self._group_lock:
                if self._generation == generation and dist.is_initialized():
                    dist.destroy_process_group()
        return asdict(result)

    def drain(self, metrics_acknowledged: int | None) -> dict[str, list[dict[str, Any]]]:
        return self._outbox.drain(metrics_acknowledged)

    def request_stop(self) -> None:
        self._outbox.request_stop()


class RankOutbox:
    """The training process's side of its rank's ProgressSink (workers/trainer/context.py): what the training thread
    records waits here until the driver drains it; the driver's stop request and acknowledgements wait here for
    training."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._drained: dict[str, list[dict[str, Any]]] = {"metrics": [], "checkpoints": [], "memory": [], "events": []}
        self._acknowledged = 0
        self._stop = threading.Event()

    def metric(self, point: MetricPoint) -> None:
        self._put("metrics", point.model_dump(exclude_none=True))

    def checkpoint(self, record: CheckpointRecord) -> None:
        """A commit's record. Its list of what storage kept supersedes those of the commits still waiting here, which
        are dropped: with checkpoint.keep in the hundreds and a commit every step, a drain holding every record's list
        would outgrow the report the API reads."""
        dumped = record.model_dump()  # before the lock, which the training thread takes for every step's metric
        with self._lock:
            for waiting in self._drained["checkpoints"]:
                waiting["kept"] = None
            self._drained["checkpoints"].append(dumped)

    def memory(self, measured: RankMemory) -> None:
        self._put("memory", measured.model_dump())

    def event(self, message: str, details: dict[str, Any]) -> None:
        self._put("events", {"message": message, "details": details})

    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def metrics_acknowledged(self) -> int:
        return self._acknowledged

    def request_stop(self) -> None:
        self._stop.set()

    def drain(self, metrics_acknowledged: int | None) -> dict[str, list[dict[str, Any]]]:
        with self._lock:
            if metrics_acknowledged is not None:
                self._acknowledged = max(self._acknowledged, metrics_acknowledged)
            drained = self._drained
            self._drained = {kind: [] for kind in drained}
        return drained

    def _put(self, kind: str, item: dict[str, Any]) -> None:
        with self._lock:
            self._drained[kind].append(item)


def form_default_group(
    backend: str, store: Any, rank: int, world_size: int, *, rendezvous: timedelta, collectives: timedelta
) -> None:
    """Initialise the default process group, waiting at most `rendezvous` for the other members (gloo connects its
    full mesh during the init, under the group's timeout), then give its collectives the `collectives` timeout."""
    import torch.distributed as dist

    from ringmaster.workers import torch_internals

    # A group's name, under which its members meet in the store, counts the groups this process made: an init that
    # failed counted one, and the next would then wait where its peers never look.
    groups_made = torch_internals.groups_made()
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=rendezvous)
    except BaseException:
        torch_internals.set_groups_made(groups_made)
        raise
    if rendezvous != collectives:
        torch_internals.set_default_group_timeout(collectives)


def _import_training_stack() -> None:
    from ringmaster.workers import torch_internals

    torch_internals.import_dynamo()  # DistributedDataParallel imports it on construction
    import ringmaster.workers.trainer  # noqa: F401


def _import_training_stack_in_background() -> None:
    """The warm-up of a pool worker: at the lowest CPU priority (this thread only), so a pool refilling on a node
    never slows the training running there; on an idle node it runs at full speed. Any job may claim it, so it also
    imports ZeRO-1's optimizer, which a worker started for its job imports only when the job shards its optimizer."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    _import_training_stack()
    import torch.distributed.optim  # noqa: F401


def _serve(
    rank: Rank, connection: Connection, send_lock: threading.Lock, call_id: int, method: str, args: tuple[Any, ...]
) -> None:
    """Run one call and send its reply: (id, True, the pickled result, "", "") or (id, False, the pickled exception or
    b"" where it cannot be pickled, its traceback from the called method on, where it ran: this process's rank in
    its group, if it is in one, and pid). The actor unpickles each reply's value in the call it answers, so a value
    it cannot rebuild fails that call only. The traceback has no "Traceback (most recent call last):" lines: Ray's
    account of the actor's exception puts its own header in place of every such line, the note's too."""
    try:
        reply = (call_id, True, pickle.dumps(getattr(rank, method)(*args)), "", "")
    except BaseException as error:
        try:
            pickled = pickle.dumps(error)
        except Exception:
            pickled = b""
        # A caught exception has a traceback, whose first entry is this frame.
        lines = traceback.format_exception(type(error), error, cast(TracebackType, error.__traceback__).tb_next)
        text = "".join(line for line in lines if not line.startswith("Traceback (most recent"))
        reply = (call_id, False, pickled, text, rank.whereabouts())
    with send_lock:
        connection.send(reply)


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it ends (Linux); if the actor is already gone, exit now."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def main() -> None:
    fd, parent_pid, pooled = int(sys.argv[1]), int(sys.argv[2]), "--pooled" in sys.argv[3:]
    _die_with_parent(parent_pid)
    if _ACTOR_PYTHONPATH in os.environ:
        os.environ["PYTHONPATH"] = os.environ.pop(_ACTOR_PYTHONPATH)
    else:
        del os.environ["PYTHONPATH"]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    connection = Connection(fd)
    rank, send_lock = Rank(pooled), threading.Lock()
    while True:
        try:
            call_id, method, args = connection.recv()
        except (EOFError, OSError):
            os._exit(0)  # the actor is gone
        threading.Thread(
            target=_serve, args=(rank, connection, send_lock, call_id, method, args), name=f"call-{method}", daemon=True
        ).start()


if __name__ == "__main__":
    main()
