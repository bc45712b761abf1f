"""RINGMASTER_CHECKPOINT_DIR on remote storage, against a real S3 protocol (moto's server, as the checkpoint storage
tests use): what a script saves (on SIGTERM too) is on the storage when its worker reports the stop or the exit; a
fresh directory on another node is filled from the storage before a start; a file still being written waits, and one
written again replaces what was uploaded; the script's deletions reach the storage; a failed upload is one note and
is retried at the next pass. Time is the test's clock, except for the script processes' own."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from harness.s3_server import s3_server
from ringmaster.workers.script.checkpoint_sync import SETTLE_S, CheckpointSync
from ringmaster.workers.script.environment import ScriptPaths
from ringmaster.workers.script.worker import ScriptWorker

BUCKET = "ringmaster-script-checkpoints"
_places = itertools.count()


@pytest.fixture(scope="module")
def s3() -> Iterator[fsspec.AbstractFileSystem]:
    """A moto S3 server on a free local port, reached through the environment as on a cluster."""
    with s3_server(BUCKET):
        yield fsspec.filesystem("s3")


@pytest.fixture
def remote(s3: fsspec.AbstractFileSystem) -> str:
    """A job's checkpoint place of its own on the storage."""
    return f"s3://{BUCKET}/plane/job-{next(_places)}/checkpoints"


def _read(s3: fsspec.AbstractFileSystem, uri: str) -> bytes | None:
    s3.invalidate_cache()
    try:
        content: bytes = s3.cat_file(uri)
        return content
    except FileNotFoundError:
        return None


def _write(path: Path, content: str, *, age_s: float = 0.0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    if age_s:
        modified = time.time() - age_s
        os.utime(path, (modified, modified))


def _files(directory: Path) -> dict[str, str]:
    return {path.relative_to(directory).as_posix(): path.read_text() for path in directory.rglob("*") if path.is_file()}


class _Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


# -- the worker: a script's last save is on the storage before its stop or exit is reported -----------------------

_SAVES_ON_SIGTERM = """
import pathlib, signal, sys, time
checkpoints = pathlib.Path(sys.argv[1])
def save(*_):
    (checkpoints / "step-7.pt").write_text("saved on SIGTERM at step 7")
    sys.exit(0)
signal.signal(signal.SIGTERM, save)
(checkpoints / "step-5.pt").write_text("step 5")
print("ready", flush=True)
time.sleep(60)
"""


def _worker(node: Path, uri: str) -> tuple[Any, dict[str, Any]]:
    """The worker actor's class itself, without Ray (its methods are plain), and the paths a driver gives it."""
    paths = ScriptPaths(str(node / "checkpoints"), str(node / "tensorboard"), uri)
    return ScriptWorker.__ray_actor_class__(1.0, False), paths.__dict__


def test_a_save_on_sigterm_is_on_the_storage_when_the_worker_reports_the_stop(
    tmp_path: Path, s3: fsspec.AbstractFileSystem, remote: str
) -> None:
    worker, paths = _worker(tmp_path / "node-a", remote)
    assert worker.fill_checkpoint_dir(paths)["error"] is None
    command = [sys.executable, "-u", "-c", _SAVES_ON_SIGTERM, paths["checkpoint_dir"]]
    assert worker.start(command, {}, paths, 1) > 0
    deadline = time.monotonic() + 20
    while not any(line == ("stdout", "ready") for line in worker.poll()["lines"]):
        assert time.monotonic() < deadline, "the script never started"
        time.sleep(0.05)
    stopped = worker.stop(10.0)
    assert stopped is not None and stopped["code"] == 0 and stopped["stopped"]
    # The stop returned: the save made in the SIGTERM handler, after the last periodic pass, is on the storage.
    assert _read(s3, f"{remote}/step-7.pt") == b"saved on SIGTERM at step 7"
    assert _read(s3, f"{remote}/step-5.pt") == b"step 5"
    polled = worker.poll()
    assert polled["exit"] is not None and any("2 files" in text for _, text in polled["notes"])


def test_a_scripts_exit_is_reported_once_its_last_save_is_on_the_storage(
    tmp_path: Path, s3: fsspec.AbstractFileSystem, remote: str
) -> None:
    worker, paths = _worker(tmp_path / "node-a", remote)
    code = "import pathlib, sys; (pathlib.Path(sys.argv[1]) / 'final.pt').write_text('done')"
    worker.start([sys.executable, "-c", code, paths["checkpoint_dir"]], {}, paths, 1)
    deadline = time.monotonic() + 20
    while (polled := worker.poll())["exit"] is None:
        assert time.monotonic() < deadline, "no exit reported"
        time.sleep(0.02)
    assert polled["exit"]["code"] == 0 and _read(s3, f"{remote}/final.pt") == b"done"


# -- before a start: a node's directory becomes the storage's ------------------------------------------------------


def test_a_fresh_node_is_filled_from_what_every_node_uploaded(
    tmp_path: Path, s3: fsspec.AbstractFileSystem, remote: str
) -> None:
    # Two nodes of the last group: rank 0's node saved the checkpoint, each node its rank's shard.
    first, second = tmp_path / "node-a" / "checkpoints", tmp_path / "node-b" / "checkpoints"
    _write(first / "step-1.pt", "one", age_s=60)
    _write(first / "step-2.pt", "two", age_s=30)
    _write(first / "checkpoint-2" / "shard-0.pt", "rank 0's shard")
    _write(second / "checkpoint-2" / "shard-1.pt", "rank 1's shard")
    for node in (first, second):
        assert CheckpointSync(str(node), remote).upload(final=True).files > 0

    # The group restarts on a node that has a stale file of its own: the directory becomes the storage's.
    fresh = tmp_path / "node-c" / "checkpoints"
    _write(fresh / "stale.pt", "never uploaded")
    filled = CheckpointSync(str(fresh), remote).fill()
    assert filled.error is None and (filled.files, filled.removed) == (4, 1)
    assert _files(fresh) == {
        "step-1.pt": "one",
        "step-2.pt": "two",
        "checkpoint-2/shard-0.pt": "rank 0's shard",
        "checkpoint-2/shard-1.pt": "rank 1's shard",
    }
    # Modification times are the uploads': the newest by mtime is the one uploaded last.
    assert (fresh / "step-1.pt").stat().st_mtime <= (fresh / "step-2.pt").stat().st_mtime
    assert CheckpointSync(str(fresh), remote).fill().files == 0  # nothing downloaded twice

    # Another node rewrote step-2.pt: the next fill takes the new version.
    _write(first / "step-2.pt", "two, again")
    CheckpointSync(str(first), remote).upload(final=True)
    assert CheckpointSync(str(fresh), remote).fill().files == 1
    assert (fresh / "step-2.pt").read_text() == "two, again"


def test_an_empty_storage_leaves_an_empty_directory(tmp_path: Path, remote: str) -> None:
    directory = tmp_path / "node-a" / "checkpoints"
    filled = CheckpointSync(str(directory), remote).fill()
    assert filled.error is None and filled.files == 0 and directory.is_dir() and _files(directory) == {}


# -- while the script runs ------------------------------------------------------------------------------------------


def test_a_file_being_written_waits_and_a_rewrite_replaces_what_was_uploaded(
    tmp_path: Path, s3: fsspec.AbstractFileSystem, remote: str
) -> None:
    directory, clock = tmp_path / "node-a" / "checkpoints", _Clock()
    sync = CheckpointSync(str(directory), remote, clock=clock)
    checkpoint = directory / "step-2.pt"
    _write(checkpoint, "the first half")
    clock.now = checkpoint.stat().st_mtime + SETTLE_S / 2  # written a moment ago: still being written
    waited = sync.upload()
    assert (waited.files, waited.waiting) == (0, 1) and _read(s3, f"{remote}/step-2.pt") is None

    clock.now += SETTLE_S  # the writer paused longer than the settle time: the half is uploaded
    assert sync.upload().files == 1 and _read(s3, f"{remote}/step-2.pt") == b"the first half"
    with checkpoint.open("a") as handle:
        handle.write(", and the rest")
    clock.now = checkpoint.stat().st_mtime + 2 * SETTLE_S
    assert sync.upload().files == 1
    assert _read(s3, f"{remote}/step-2.pt") == b"the first half, and the rest"
    assert sync.upload().files == 0  # uploaded once per change


def test_a_checkpoint_directory_is_uploaded_once_nothing_in_it_is_written(
    tmp_path: Path, s3: fsspec.AbstractFileSystem, remote: str
) -> None:
    """A Trainer's checkpoint-<step>/ whose weights are written but whose trainer_state.json is being written: none
    of it yet; then all of it."""
    directory, clock = tmp_path / "node-a" / "checkpoints", _Clock()
    sync = CheckpointSync(str(directory), remote, clock=clock)
    _write(directory / "checkpoint-10" / "model.safetensors", "weights", age_s=3 * SETTLE_S)
    _write(directory / "checkpoint-10" / "trainer_state.json", "{")
    clock.now = time.time()
    assert sync.upload().files == 0 and _read(s3, f"{remote}/checkpoint-10/model.safetensors") is None
    clock.now += 2 * SETTLE_S
    assert sync.upload().files == 2
    assert _read(s3, f"{remote}/checkpoint-10/trainer_state.json") == b"{"


def test_what_the_script_deletes_is_deleted_from_the_storage(
    tmp_path: Path, s3: fsspec.AbstractFileSystem, remote: str
) -> None:
    first, second = tmp_path / "node-a" / "checkpoints", tmp_path / "node-b" / "checkpoints"
    _write(first / "checkpoint-1" / "model.pt", "old", age_s=60)
    _write(first / "checkpoint-2" / "model.pt", "new", age_s=60)
    _write(second / "rank-1.pt", "node b's", age_s=60)
    sync = CheckpointSync(str(first), remote)
    sync.upload()
    CheckpointSync(str(second), remote).upload()
    # The script rotates its checkpoints (a Trainer's save_total_limit): the old one goes from the storage too, and
    # what another node uploaded, which this node never had, stays.
    (first / "checkpoint-1" / "model.pt").unlink()
    assert sync.upload().removed == 1
    assert _read(s3, f"{remote}/checkpoint-1/model.pt") is None
    assert _read(s3, f"{remote}/checkpoint-2/model.pt") == b"new"
    assert _read(s3, f"{remote}/rank-1.pt") == b"node b's"


def test_a_failed_upload_is_one_note_and_is_retried_at_the_next_pass(
    tmp_path: Path, s3: fsspec.AbstractFileSystem
) -> None:
    bucket = f"ringmaster-not-yet-{next(_places)}"
    remote = f"s3://{bucket}/job/checkpoints"
    directory = tmp_path / "node-a" / "checkpoints"
    _write(directory / "step-1.pt", "one", age_s=60)
    sync = CheckpointSync(str(directory), remote, every_s=0.0, retry_wait_s=0.0)
    looks = itertools.count(1)

    def ended(timeout_s: float) -> bool:
        look = next(looks)
        if look == 3:
            s3.makedirs(bucket, exist_ok=True)  # the storage is reachable again before the third pass
        return look == 4

    sync.follow(ended)
    notes = sync.drain_notes()
    assert [level for level, _ in notes] == [logging.WARNING, logging.INFO]  # two failed passes, one line
    warning = notes[0][1]
    assert warning.startswith(f"uploading 1 file of RINGMASTER_CHECKPOINT_DIR to {remote} failed, retried every")
    assert "step-1.pt" in warning and "Traceback" not in warning and "\n" not in warning
    assert "work again" in notes[1][1] and sync.finished.is_set()
    assert _read(s3, f"{remote}/step-1.pt") == b"one"


def test_a_final_upload_that_fails_says_where_the_files_remain(tmp_path: Path, s3: fsspec.AbstractFileSystem) -> None:
    remote = f"s3://ringmaster-never-made-{next(_places)}/job/checkpoints"
    directory = tmp_path / "node-a" / "checkpoints"
    _write(directory / "step-9.pt", "nine")
    sync = CheckpointSync(str(directory), remote, retry_wait_s=0.0)
    sync.follow(lambda timeout_s: True)  # the script has ended: only the final pass, tried three times
    notes = sync.drain_notes()
    assert len(notes) == 1 and notes[0][0] == logging.WARNING and sync.finished.is_set()
    assert f"the final upload of RINGMASTER_CHECKPOINT_DIR to {remote} failed" in notes[0][1]
    assert f"only in {directory} on this node" in notes[0][1] and "\n" not in notes[0][1]
