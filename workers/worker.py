"""One Ray actor per GPU (or CPU share): joins the process group and runs the training loop.

A threaded actor, so the driver can drain metrics, send heartbeats and re-form the group while
`train` runs. Each group the actor joins has a generation: joining a new one aborts the old, and a
training call from an old generation (stuck behind a frozen peer) never tears down the new group.
The training loop itself never talks to the control plane. The calls made every second or so for a
worker's whole life (heartbeat, drain, pool status) record no Ray task events: those would cost GCS
work on CPUs training may share, and bury the job's real tasks in the dashboard.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import ray

# train (possibly one stuck from an abandoned generation), its successor, drain, join, stop, warm_up.
_CONCURRENT_CALLS = 8
# Heartbeats and the pool's status calls have threads of their own: they never queue behind the calls above, so a
# busy worker is not taken for a lost one.
_CONTROL_CALLS = 2
# A claimed pool worker is detached, so Ray does not end it with its driver: after this long without a heartbeat it
# asks the cluster whether the driver's Ray job is still alive, and exits if not (see `_end_with_owner`).
_OWNER_SILENCE_S = 1.0

log = logging.getLogger("ringmaster.worker")


def _import_training_stack() -> None:
    import torch._dynamo  # noqa: F401 — DistributedDataParallel imports it on construction

    import ringmaster.workers.trainer  # noqa: F401


def _import_training_stack_in_background() -> None:
    """The warm-up of a pool worker: at the lowest CPU priority (this thread only), so a pool refilling on a node
    never slows the training running there; on an idle node it runs at full speed. Any job may claim it, so it also
    imports ZeRO-1's optimizer, which a worker started for its job imports only when the job shards its optimizer."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    _import_training_stack()
    import torch.distributed.optim  # noqa: F401


def form_default_group(backend: str, store: Any, rank: int, world_size: int, *, rendezvous: timedelta,
                       collectives: timedelta) -> None:
    """Initialise the default process group, waiting at most `rendezvous` for the other members (gloo connects its
    full mesh during the init, under the group's timeout), then give its collectives the `collectives` timeout."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    from torch.distributed.distributed_c10d import _set_pg_timeout

    # A group's name, under which its members meet in the store, counts the groups this process made: an init that
    # failed counted one, and the next would then wait where its peers never look.
    groups_made = distributed_c10d._world.group_count
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=rendezvous)
    except BaseException:
        distributed_c10d._world.group_count = groups_made
        raise
    if rendezvous != collectives:
        _set_pg_timeout(collectives)


@ray.remote(max_concurrency=_CONCURRENT_CALLS, concurrency_groups={"control": _CONTROL_CALLS})
class TrainWorker:
    def __init__(self, cpus: float, uses_gpu: bool, pooled: bool = False) -> None:
        """`pooled`: a worker of the cluster's warm pool (`workers/warm_pool.py`), idle until a job claims it."""
        self._cpus = cpus
        self._uses_gpu = uses_gpu
        self._claimant: str | None = None
        self._last_heartbeat = time.monotonic()
        self._lock = threading.Lock()
        self._group_lock = threading.Lock()
        self._outbox = RankOutbox()
        self._snapshots: Any = None  # this process's in-memory snapshots, made with the training stack
        self._rendezvous: socket.socket | None = None  # where the group this actor leads next meets (rendezvous_port)
        self.generation = 0
        # Import the training stack while the driver is still placing and ranking the other workers.
        warm_up = _import_training_stack_in_background if pooled else _import_training_stack
        self._warm = threading.Thread(target=warm_up, name="warm-up", daemon=True)
        self._warm.start()

    @ray.method(concurrency_group="control", enable_task_events=False)
    def pool_status(self) -> dict[str, Any]:
        """A pool worker's state: the job attempt (Ray submission id) that claimed it, if any, and whether it is warm."""
        with self._lock:
            return {"claimant": self._claimant, "warm": not self._warm.is_alive()}

    @ray.method(concurrency_group="control")
    def claim(self, claimant: str, cpus: float, owner_job_id: str) -> bool:
        """Take this idle pool worker for one job attempt, training on `cpus` CPUs of a bundle on this node; False
        when another attempt claimed it first. A claimed worker serves that attempt only and ends with it: with the
        Ray job `owner_job_id` (hex) of the attempt's driver."""
        with self._lock:
            if self._claimant is not None:
                return False
            self._claimant, self._cpus = claimant, cpus
        threading.Thread(target=self._end_with_owner, args=(owner_job_id,), name="owner-watch", daemon=True).start()
        return True

    def _end_with_owner(self, owner_job_id: str) -> None:
        """Exit once the claiming driver's Ray job is dead. Ray ends the workers a driver created along with it; a pool
        worker is detached, and would otherwise go on training the attempt and committing its checkpoints beside the
        attempt that replaces it. Asks the cluster only after a silence: a live driver heartbeats every half second."""
        gcs = ray._private.worker.global_worker.gcs_client
        while True:
            time.sleep(_OWNER_SILENCE_S / 2)
            if time.monotonic() - self._last_heartbeat < _OWNER_SILENCE_S:
                continue
            try:
                jobs = gcs.get_all_job_info(job_or_submission_id=owner_job_id, skip_submission_job_info_field=True,
                                            skip_is_running_tasks_field=True, timeout=_OWNER_SILENCE_S * 5)
            except Exception as error:  # noqa: BLE001 — the GCS restarting or slow: not a verdict on the driver
                log.warning("cannot ask the cluster about Ray job %s (%s); asking again", owner_job_id, error)
                continue
            if all(job.is_dead for job in jobs.values()):
                log.warning("the driver (Ray job %s) of attempt %s is gone; this pool worker ends with it",
                            owner_job_id, self._claimant)
                os._exit(1)

    def placement(self) -> dict[str, Any]:
        """Where this actor landed: its node id (the rank-ordering key), IP and process."""
        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "actor_id": context.get_actor_id(), "name": context.get_actor_name()}

    def rendezvous_port(self) -> int:
        """Open a listening socket on a port the system chooses, for the rendezvous store of the group this actor will
        lead as rank 0 (join hands it to the store), and return the port. A port found free and bound only later can
        be taken in between: on a busy node, by another group's connections."""
        listening = socket.socket()
        listening.bind((ray.util.get_node_ip_address(), 0))
        listening.listen()
        if self._rendezvous is not None:
            self._rendezvous.close()
        self._rendezvous = listening
        return listening.getsockname()[1]

    def resume_step(self, storage_root: str, resume_from_root: str | None) -> int:
        """The step training will resume from (0: from scratch), chosen as training chooses it."""
        from ringmaster.workers.checkpoint import find_resume_point

        latest = find_resume_point(storage_root)[0]
        if latest is None and resume_from_root is not None:
            latest = find_resume_point(resume_from_root)[0]
        return latest.step if latest is not None else 0

    def snapshot_inventory(self, job_id: str) -> list[dict[str, Any]]:
        """What this worker holds of the job's in-memory snapshots ([] for a new worker)."""
        return [] if self._snapshots is None else self._snapshots.inventory(job_id)

    def warm_up(self) -> None:
        """Returns once the training stack is imported: a standby is ready to join a group at once."""
        self._warm.join()

    @ray.method(concurrency_group="control", enable_task_events=False)
    def heartbeat(self) -> int:
        self._last_heartbeat = time.monotonic()
        return self.generation

    def join(self, generation: int, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float,
             rendezvous_timeout_s: float) -> None:
        """Leave the previous group (abort: a peer may be gone mid-collective) and form the new one. `timeout_s`: the
        group's collectives'; `rendezvous_timeout_s` (at most that): how long this member waits for the others to
        form it. A member lost while the group forms leaves the others waiting: they give up after the shorter wait
        and are free for the driver's next formation, which waits for them (its store's timeout is `timeout_s`)."""
        import torch
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _abort_process_group

        torch.set_num_threads(max(1, int(self._cpus)))  # one intra-op thread per CPU granted
        with self._group_lock:
            if dist.is_initialized():
                _abort_process_group()
            self.generation = generation
            # The new group's training counts its points from zero. An earlier group's undrained points are replayed
            # from the checkpoint the new group resumes from, which kept them.
            self._outbox = RankOutbox()
            if self._uses_gpu:
                torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU.
                # A collective a lost peer broke: the watchdog aborts the communicators when it times out, but leaves
                # the process alive (torch's default, 3, ends it), so the survivor keeps its state and its snapshots
                # for the re-formed group. The driver's re-formation aborts them sooner (the join above).
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
            timeout = timedelta(seconds=timeout_s)
            if rank == 0:  # the store serves on the socket rendezvous_port opened, and owns it from now on
                listening, self._rendezvous = self._rendezvous, None
                store = dist.TCPStore(master_addr, master_port, world_size, is_master=True, timeout=timeout,
                                      wait_for_workers=False, master_listen_fd=listening.detach())
            else:
                store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
            # As init_method="tcp://..." would, under the prefix torch gives the default group's keys.
            form_default_group("nccl" if self._uses_gpu else "gloo", dist.PrefixStore("default_pg", store), rank,
                               world_size, rendezvous=timedelta(seconds=min(timeout_s, rendezvous_timeout_s)),
                               collectives=timeout)

    def train(self, generation: int, spec_json: str, job_id: str, storage_root: str, ranks_per_node: list[int],
              resume_from_root: str | None = None, attempt: int = 1,
              memory_resume: dict[str, int] | None = None) -> dict[str, Any]:
        """`memory_resume`: {"generation", "step"} of the in-memory snapshot the driver chose (None: from storage)."""
        import torch
        import torch.distributed as dist

        # The group formed while the warm-up thread imported the rest; training needs all of it.
        self._warm.join()
        from ringmaster.service.spec import JobSpec
        from ringmaster.workers.memory_snapshots import SnapshotRef, SnapshotStore
        from ringmaster.workers.trainer import TrainContext, run_training

        if self._snapshots is None:
            self._snapshots = SnapshotStore()
        spec = JobSpec.model_validate_json(spec_json)
        device = torch.device("cuda", 0) if self._uses_gpu else torch.device("cpu")
        context = TrainContext(
            rank=dist.get_rank(), world_size=dist.get_world_size(), device=device, job_id=job_id,
            storage_root=storage_root, sink=self._outbox, ranks_per_node=tuple(ranks_per_node), generation=generation,
            resume_from_root=resume_from_root, attempt=attempt, snapshot_store=self._snapshots,
            memory_resume=SnapshotRef(**memory_resume) if memory_resume else None,
        )
        try:
            result = run_training(spec, context)
        finally:
            with self._group_lock:
                if self.generation == generation and dist.is_initialized():
                    dist.destroy_process_group()
        return asdict(result)

    @ray.method(enable_task_events=False)
    def drain(self, metrics_acknowledged: int | None = None) -> dict[str, list[dict[str, Any]]]:
        """Hand over what this rank recorded since the last drain (metrics, checkpoints and events come from rank 0
        only, memory from every rank). `metrics_acknowledged`: how many of this training call's metric points the
        control plane has stored by now (workers/metric_ledger.py)."""
        return self._outbox.drain(metrics_acknowledged)

    def request_stop(self) -> None:
        """Stop after the current step with a checkpoint: the boundary at which the group regrows."""
        self._outbox.request_stop()


class RankOutbox:
    """The worker's side of its rank's ProgressSink (workers/trainer/context.py): what the training thread records
    waits here until the driver drains it; the driver's stop request and acknowledgements wait here for training."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._drained: dict[str, list[dict[str, Any]]] = {"metrics": [], "checkpoints": [], "memory": [], "events": []}
        self._acknowledged = 0
        self._stop = threading.Event()

    def metric(self, point) -> None:
        self._put("metrics", point.model_dump(exclude_none=True))

    def checkpoint(self, record) -> None:
        self._put("checkpoints", record.model_dump())

    def memory(self, measured) -> None:
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
