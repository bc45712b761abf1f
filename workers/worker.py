"""One Ray actor per GPU (or CPU share): joins the process group and runs the training loop.

A threaded actor (two concurrent calls) so the driver can drain metrics and ask it to stop while
`train` runs; the training loop itself never talks to the control plane.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import ray


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@ray.remote(max_concurrency=2)
class TrainWorker:
    def __init__(self, cpus: float, uses_gpu: bool) -> None:
        self._cpus = cpus
        self._uses_gpu = uses_gpu
        self._lock = threading.Lock()
        self._metrics: list[dict[str, Any]] = []
        self._checkpoints: list[dict[str, Any]] = []
        self._memory: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self.rank: int | None = None

    def placement(self) -> dict[str, Any]:
        """Where this actor landed: node id (the rank-ordering key), IP and a free port for rendezvous."""
        context = ray.get_runtime_context()
        ip = ray.util.get_node_ip_address()
        return {"node_id": context.get_node_id(), "ip": ip, "port": _free_port(ip), "pid": os.getpid()}

    def join(self, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        # One intra-op thread per CPU granted: oversubscribing the node's cores slows every rank.
        torch.set_num_threads(max(1, int(self._cpus)))
        backend = "nccl" if self._uses_gpu else "gloo"
        if self._uses_gpu:
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU.
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        self.rank = rank

    def train(self, spec_json: str, job_id: str, storage_root: str, ranks_per_node: list[int]) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        from service.spec import JobSpec
        from workers.training import TrainContext, run_training

        spec = JobSpec.model_validate_json(spec_json)
        device = torch.device("cuda", 0) if self._uses_gpu else torch.device("cpu")
        context = TrainContext(
            rank=dist.get_rank(), world_size=dist.get_world_size(), device=device, job_id=job_id,
            storage_root=storage_root, on_metric=self._record_metric, on_checkpoint=self._record_checkpoint,
            should_stop=self._stop.is_set, on_memory=self._record_memory, ranks_per_node=tuple(ranks_per_node),
        )
        try:
            result = run_training(spec, context)
        finally:
            dist.destroy_process_group()
        return asdict(result)

    def _record_metric(self, point) -> None:
        with self._lock:
            self._metrics.append(point.model_dump(exclude_none=True))

    def _record_checkpoint(self, record) -> None:
        with self._lock:
            self._checkpoints.append(record.model_dump())

    def _record_memory(self, measured) -> None:
        with self._lock:
            self._memory.append(measured.model_dump())

    def drain(self) -> dict[str, list[dict[str, Any]]]:
        """Hand over what this rank recorded since the last drain (metrics and checkpoints come from
        rank 0 only, memory from every rank); doubles as a liveness probe."""
        with self._lock:
            metrics, self._metrics = self._metrics, []
            checkpoints, self._checkpoints = self._checkpoints, []
            memory, self._memory = self._memory, []
        return {"metrics": metrics, "checkpoints": checkpoints, "memory": memory}

    def request_stop(self) -> None:
        self._stop.set()
