"""One Ray actor per GPU (or CPU share): its training process joins the process group and runs the training loop.

The actor answers the driver and the pool; everything that touches torch runs in a child process the actor starts
(workers/rank_process.py: away from Ray's threads, which would otherwise share the training thread's GIL). The two
live and die together. A threaded actor, so the driver can drain metrics, send heartbeats and re-form the group while
`train` runs. Each group the actor joins has a generation: joining a new one aborts the old, and a
training call from an old generation (stuck behind a frozen peer) never tears down the new group.
The training loop itself never talks to the control plane. The calls made every second or so for a
worker's whole life (heartbeat, drain, pool status) record no Ray task events: those would cost GCS
work on CPUs training may share, and bury the job's real tasks in the dashboard.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import ray

from ringmaster.workers.rank_process import RankProcess

# train (possibly one stuck from an abandoned generation), its successor, drain, join, stop, warm_up.
_CONCURRENT_CALLS = 8
# Heartbeats and the pool's status calls have threads of their own: they never queue behind the calls above, so a
# busy worker is not taken for a lost one.
_CONTROL_CALLS = 2
# A claimed pool worker is detached, so Ray does not end it with its driver: after this long without a heartbeat it
# asks the cluster whether the driver's Ray job is still alive, and exits if not (see `_end_with_owner`).
_OWNER_SILENCE_S = 1.0

log = logging.getLogger("ringmaster.worker")


# Ray's typed overloads of ray.remote leave out the actor options max_concurrency and concurrency_groups.
@ray.remote(max_concurrency=_CONCURRENT_CALLS, concurrency_groups={"control": _CONTROL_CALLS})  # type: ignore[call-overload]
class TrainWorker:
    def __init__(self, cpus: float, uses_gpu: bool, pooled: bool = False) -> None:
        """`pooled`: a worker of the cluster's warm pool (`workers/warm_pool.py`), idle until a job claims it."""
        self._cpus = cpus
        self._uses_gpu = uses_gpu
        self._claimant: str | None = None
        self._owner_checks = 0  # times a claimed pool worker asked the cluster and found its driver alive
        self._last_heartbeat = time.monotonic()
        self._lock = threading.Lock()
        self._rank = RankProcess(pooled=pooled)
        self._warm = threading.Event()
        threading.Thread(target=self._wait_until_warm, name="warm-up", daemon=True).start()
        self.generation = 0

    def _wait_until_warm(self) -> None:
        self._rank.call("warm_up")
        self._warm.set()

    @ray.method(concurrency_group="control", enable_task_events=False)
    def pool_status(self) -> dict[str, Any]:
        """A pool worker's state: the job attempt (Ray submission id) that claimed it, if any, whether it is warm, and
        how many times (once claimed) it asked the cluster about its driver after a silence and found it alive."""
        with self._lock:
            return {"claimant": self._claimant, "warm": self._warm.is_set(), "owner_checks": self._owner_checks}

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
        gcs = ray._private.worker.global_worker.gcs_client  # type: ignore[attr-defined]  # set by ray.init, undeclared
        while True:
            time.sleep(_OWNER_SILENCE_S / 2)
            if time.monotonic() - self._last_heartbeat < _OWNER_SILENCE_S:
                continue
            try:
                jobs = gcs.get_all_job_info(
                    job_or_submission_id=owner_job_id,
                    skip_submission_job_info_field=True,
                    skip_is_running_tasks_field=True,
                    timeout=_OWNER_SILENCE_S * 5,
                )
            except Exception as error:
                log.warning("cannot ask the cluster about Ray job %s (%s); asking again", owner_job_id, error)
                continue
            if all(job.is_dead for job in jobs.values()):
                log.warning(
                    "the driver (Ray job %s) of attempt %s is gone; this pool worker ends with it",
                    owner_job_id,
                    self._claimant,
                )
                os._exit(1)
            with self._lock:
                self._owner_checks += 1

    def placement(self) -> dict[str, Any]:
        """Where this actor landed: its node id (the rank-ordering key), IP, process and training process."""
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]  # Ray leaves it unannotated
            "pid": os.getpid(),
            "training_pid": self._rank.pid,
            "actor_id": context.get_actor_id(),
            "name": context.get_actor_name(),
        }

    def rendezvous_port(self) -> int:
        """Open a listening socket for the rendezvous store of the group this worker will lead as rank 0, and return
        its port (Rank.rendezvous_port)."""
        ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # Ray leaves it unannotated
        port: int = self._rank.call("rendezvous_port", ip)
        return port

    def resume_step(self, storage_root: str, resume_from_root: str | None) -> int:
        """The step training will resume from (0: from scratch), chosen as training chooses it."""
        step: int = self._rank.call("resume_step", storage_root, resume_from_root)
        return step

    def snapshot_inventory(self, job_id: str) -> list[dict[str, Any]]:
        """What this worker holds of the job's in-memory snapshots ([] for a new worker)."""
        inventory: list[dict[str, Any]] = self._rank.call("snapshot_inventory", job_id)
        return inventory

    def warm_up(self) -> None:
        """Returns once the training stack is imported: a standby is ready to join a group at once."""
        self._warm.wait()

    @ray.method(concurrency_group="control", enable_task_events=False)
    def heartbeat(self) -> int:
        self._last_heartbeat = time.monotonic()
        return self.generation

    def join(
        self,
        generation: int,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        timeout_s: float,
        rendezvous_timeout_s: float,
    ) -> None:
        """Leave the previous group (abort: a peer may be gone mid-collective) and form the new one. `timeout_s`: the
        group's collectives'; `rendezvous_timeout_s` (at most that): how long this member waits for the others to
        form it. A member lost while the group forms leaves the others waiting: they give up after the shorter wait
        and are free for the driver's next formation, which waits for them (its store's timeout is `timeout_s`)."""
        self.generation = generation
        self._rank.call(
            "join",
            self._cpus,
            self._uses_gpu,
            generation,
            rank,
            world_size,
            master_addr,
            master_port,
            timeout_s,
            rendezvous_timeout_s,
        )

    def train(
        self,
        generation: int,
        spec_json: str,
        job_id: str,
        storage_root: str,
        ranks_per_node: list[int],
        resume_from_root: str | None = None,
        attempt: int = 1,
        resume_snapshot: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """`resume_snapshot`: {"generation", "step"} of the in-memory snapshot the driver chose (None: from storage)."""
        result: dict[str, Any] = self._rank.call(
            "train",
            self._uses_gpu,
            generation,
            spec_json,
            job_id,
            storage_root,
            ranks_per_node,
            resume_from_root,
            attempt,
            resume_snapshot,
        )
        return result

    @ray.method(enable_task_events=False)
    def drain(self, metrics_acknowledged: int | None = None) -> dict[str, list[dict[str, Any]]]:
        """Hand over what this rank recorded since the last drain (metrics, checkpoints and events come from rank 0
        only, memory from every rank). `metrics_acknowledged`: how many of this training call's metric points the
        control plane has stored by now (workers/metric_ledger.py)."""
        drained: dict[str, list[dict[str, Any]]] = self._rank.call("drain", metrics_acknowledged)
        return drained

    def request_stop(self) -> None:
        """Stop after the current step with a checkpoint: the boundary at which the group regrows."""
        self._rank.call("request_stop")
