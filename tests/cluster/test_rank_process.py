"""A worker's training process and its actor are one failure unit: either one's death ends the other, so the driver
sees a lost worker exactly as it did when training ran in the actor; an exception in the training process reaches
the caller with its own type and the training process's traceback."""

from __future__ import annotations

import os
import pickle
import re
import signal
import time
import traceback
from pathlib import Path

import pytest
import ray
from ray.exceptions import RayActorError, RayTaskError

from ringmaster.service.spec import JobSpec
from ringmaster.workers.driver.policies import describe_task_error
from ringmaster.workers.rank_process import raised_error
from ringmaster.workers.worker import TrainWorker

pytestmark = pytest.mark.integration

ENDS_WITHIN_S = 15.0


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _started_worker() -> tuple[ray.actor.ActorHandle, dict]:
    worker = TrainWorker.options(num_cpus=0).remote(1, False)
    ray.get(worker.warm_up.remote(), timeout=120)
    placement = ray.get(worker.placement.remote())
    assert placement["training_pid"] != placement["pid"] and _running(placement["training_pid"]), placement
    return worker, placement


def test_the_worker_ends_when_its_training_process_dies(local_ray) -> None:
    worker, placement = _started_worker()
    os.kill(placement["training_pid"], signal.SIGKILL)
    deadline = time.monotonic() + ENDS_WITHIN_S
    with pytest.raises(RayActorError):
        while time.monotonic() < deadline:
            ray.get(worker.heartbeat.remote(), timeout=ENDS_WITHIN_S)
            time.sleep(0.1)
    assert not _running(placement["pid"])


def test_the_training_process_ends_when_its_worker_is_killed(local_ray) -> None:
    worker, placement = _started_worker()
    ray.kill(worker, no_restart=True)
    deadline = time.monotonic() + ENDS_WITHIN_S
    while _running(placement["training_pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(placement["training_pid"])


def test_an_exception_in_the_training_process_keeps_its_type_and_traceback(local_ray) -> None:
    worker, placement = _started_worker()
    try:
        # No group joined: training cannot ask for its rank.
        spec_json = JobSpec.model_validate({"name": "no-group", "model": "tiny-gpt"}).model_dump_json()
        with pytest.raises(RayTaskError) as raised:
            ray.get(worker.train.remote(1, spec_json, "job", "/nonexistent", [1]), timeout=60)
        assert isinstance(raised.value.cause, ValueError), raised.value
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(raised.value))
        # Ray's account of the failed call, then the training process's: where training raised.
        assert text.startswith("ray::TrainWorker.train()"), text
        assert f"Raised in the worker's training process (no group yet, pid {placement['training_pid']}):" in text, text
        assert ", in train\n" in text, text
        # The job's error: where, then the training process's traceback alone (not the actor's frames that handed
        # the call on, nor the process's own serving frame), its exception once.
        described = describe_task_error(raised.value)
        assert described.startswith(
            f"training raised an exception on no group yet, pid {placement['training_pid']}, "
            f"node {ray.util.get_node_ip_address()}\n"
        ), described
        _where, traceback_text = described.split("\n", 1)
        assert traceback_text.startswith("Traceback (most recent call last):\n  File "), described
        assert ", in train\n" in traceback_text and "workers/worker.py" not in traceback_text, described
        assert "_serve" not in traceback_text and traceback_text.count("Traceback") == 1, described
        assert traceback_text.rstrip().endswith(
            "ValueError: Default process group has not been initialized, please make sure to call init_process_group."
        ), described
        assert traceback_text.count("ValueError: Default process group") == 1, described
        # The call failed, the worker did not: it still answers and trains later calls.
        assert ray.get(worker.heartbeat.remote()) == 0
        assert _running(placement["training_pid"])
    finally:
        ray.kill(worker, no_restart=True)


class _TwoPartError(Exception):
    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what}: {why}")


def test_an_exception_that_cannot_be_rebuilt_is_raised_as_its_tracebacks_last_line() -> None:
    try:
        raise _TwoPartError("loading", "no such shard")
    except _TwoPartError as error:
        payload, text = pickle.dumps(error), traceback.format_exc()
    with pytest.raises(TypeError):
        pickle.loads(payload)  # pickled with one argument, rebuilt with two
    rebuilt = raised_error(payload, text, "rank 1 of 2, pid 4567")
    assert type(rebuilt) is RuntimeError and str(rebuilt).endswith("._TwoPartError: loading: no such shard"), rebuilt
    assert rebuilt.__notes__ == [f"Raised in the worker's training process (rank 1 of 2, pid 4567):\n{text.rstrip()}"]
    assert type(raised_error(b"", text, "pid 1")) is RuntimeError
    assert type(raised_error(pickle.dumps(ValueError("bad")), "ValueError: bad", "pid 1")) is ValueError
