"""The worker actor of a script job: one per placement-group bundle, as TrainWorker is for a managed job, placed and
ranked by the same worker group (workers/driver/worker_group.py). It imports no torch: the script's process does.

It starts the command once per run of the group (a restart starts a new one), hands the driver its output, its exit
and (rank 0) its metric points, and stops it on request. A threaded actor, so a poll or a heartbeat is answered while
a stop waits out its grace. On remote storage it also keeps RINGMASTER_CHECKPOINT_DIR synced (checkpoint_sync.py):
filled before a start, uploaded while the script runs, and once more after it ends, before its exit is reported.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time
from dataclasses import asdict
from typing import Any

import ray

from ringmaster.workers.script.checkpoint_sync import FINAL_UPLOAD_WAIT_S, CheckpointSync, Note, Synced
from ringmaster.workers.script.environment import ScriptPaths, ensure_directories, process_environment
from ringmaster.workers.script.metric_sources import ReportedMetrics, TensorBoardScalars
from ringmaster.workers.script.process import ScriptProcess

_CONCURRENT_CALLS = 4  # start or stop, poll, free_port, placement
_CONTROL_CALLS = 1  # heartbeats never queue behind a stop's grace
TENSORBOARD_READ_EVERY_S = 2.0  # a look through the script's TensorBoard directory


@ray.remote(max_concurrency=_CONCURRENT_CALLS, concurrency_groups={"control": _CONTROL_CALLS})  # type: ignore[call-overload]
class ScriptWorker:
    def __init__(self, cpus: float, uses_gpu: bool) -> None:
        """The arguments TrainWorker takes: the worker group starts either the same way."""
        self._cpus, self._uses_gpu = cpus, uses_gpu
        self._process: ScriptProcess | None = None
        self._sync: CheckpointSync | None = None  # remote storage only: the current run's
        self._metric_sources: tuple[ReportedMetrics, TensorBoardScalars] | None = None
        self._tensorboard_read_at = 0.0
        self._metrics_dir = tempfile.mkdtemp(prefix="ringmaster-metrics-")

    def placement(self) -> dict[str, Any]:
        """Where this actor landed (RankedWorker.placed's fields), and the GPUs Ray gave it."""
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]  # Ray leaves it unannotated
            "pid": os.getpid(),
            "training_pid": self._process.pid if self._process is not None else 0,
            "actor_id": context.get_actor_id(),
            "name": context.get_actor_name(),
            "gpu_ids": [str(gpu) for gpu in context.get_accelerator_ids().get("GPU", [])] if self._uses_gpu else [],
        }

    def free_port(self) -> int:
        """A port free now on this node, for MASTER_PORT when this worker is rank 0 (as torchrun picks one)."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            port: int = probe.getsockname()[1]
        return port

    @ray.method(concurrency_group="control")
    def heartbeat(self) -> int:
        return 0

    def fill_checkpoint_dir(self, paths: dict[str, Any]) -> dict[str, Any]:
        """Before a start, on remote storage: make this node's RINGMASTER_CHECKPOINT_DIR a copy of the storage's (the
        driver waits for every worker's before it starts any script). What was done: a Synced's fields."""
        script_paths = ScriptPaths(**paths)
        ensure_directories(script_paths)
        if script_paths.checkpoint_uri is None:
            return asdict(Synced())
        return asdict(CheckpointSync(script_paths.checkpoint_dir, script_paths.checkpoint_uri).fill())

    def start(self, command: list[str], rank_variables: dict[str, str], paths: dict[str, Any], rank: int) -> int:
        """Start one run of the command with the rank's variables, in the job's code directory (this worker's working
        directory); rank 0 also reads its metric points. Returns the process's pid (0: it could not start)."""
        script_paths = ScriptPaths(**paths)
        ensure_directories(script_paths)
        metrics_file = os.path.join(self._metrics_dir, f"rank-{rank}-{time.time_ns()}.jsonl")
        environment = process_environment(dict(os.environ), rank_variables, metrics_file)
        self._metric_sources = (
            (ReportedMetrics(metrics_file), TensorBoardScalars(script_paths.tensorboard_dir)) if rank == 0 else None
        )
        process = self._process = ScriptProcess(command, environment, os.getcwd())
        process.start()
        if script_paths.checkpoint_uri is not None:
            sync = self._sync = CheckpointSync(script_paths.checkpoint_dir, script_paths.checkpoint_uri)
            threading.Thread(target=sync.follow, args=(process.wait,), name="checkpoint-sync", daemon=True).start()
        return process.pid

    def poll(self) -> dict[str, Any]:
        """What happened since the last poll: output lines, metric points (rank 0), and the exit once there is one."""
        process, sync = self._process, self._sync
        if process is None:
            return {"lines": [], "dropped": 0, "metrics": [], "exit": None, "stderr_tail": [], "notes": []}
        ended = process.exit  # read before draining: every line of an ended process is drained with its exit
        if sync is not None and not sync.finished.is_set():
            ended = None  # its exit is reported once what it saved last is on the storage
        lines, dropped = process.drain()
        return {
            "lines": lines,
            "dropped": dropped,
            "metrics": self._read_metrics(final=ended is not None),
            "exit": None if ended is None else ended.as_dict(),
            "stderr_tail": process.stderr_tail if ended is not None else [],
            "notes": self._notes(),
        }

    def _notes(self) -> list[Note]:
        """What the checkpoint sync has to say (its failures, the final upload), for the driver's log and events."""
        return self._sync.drain_notes() if self._sync is not None else []

    def _read_metrics(self, final: bool) -> list[dict[str, Any]]:
        if self._metric_sources is None:
            return []
        reported, tensorboard = self._metric_sources
        points = reported.read()
        now = time.monotonic()
        if final or now - self._tensorboard_read_at >= TENSORBOARD_READ_EVERY_S:
            self._tensorboard_read_at = now
            points += tensorboard.read()
        return points

    def stop(self, grace_s: float) -> dict[str, Any] | None:
        """Stop the run (SIGTERM, `grace_s`, SIGKILL); how it ended, None if it never ran."""
        if self._process is None:
            return None
        ended = self._process.stop(grace_s)
        sync = self._sync
        if sync is not None and not sync.finished.wait(FINAL_UPLOAD_WAIT_S):
            sync.note(
                logging.WARNING,
                f"the final upload of RINGMASTER_CHECKPOINT_DIR to {sync.remote_uri} still runs after "
                f"{FINAL_UPLOAD_WAIT_S:g} s; the script's last save may not be there",
            )
        return None if ended is None else ended.as_dict()
