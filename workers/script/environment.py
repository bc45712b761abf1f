"""The environment a script's process gets: what torchrun gives a rank, and where ringmaster keeps the script's files.

Pure: the driver computes each rank's variables from the ranked group (environment_for_ranks), the worker adds them
to its own environment (process_environment). tests/workers/script/test_environment.py checks them against torchrun's.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from ringmaster.workers.script.report import METRICS_FILE_VARIABLE

CHECKPOINT_DIR_VARIABLE = "RINGMASTER_CHECKPOINT_DIR"
CHECKPOINT_URI_VARIABLE = "RINGMASTER_CHECKPOINT_URI"
TENSORBOARD_DIR_VARIABLE = "RINGMASTER_TENSORBOARD_DIR"
HF_TENSORBOARD_DIR_VARIABLE = "TENSORBOARD_LOGGING_DIR"  # where a Hugging Face Trainer writes its event files
SCRIPT_CHECKPOINTS = "checkpoints"  # under the job's storage root
SCRIPT_TENSORBOARD = "script"  # under the attempt's TensorBoard directory, beside the driver's own event files


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs: its node (the group's workers are ranked node by node) and the GPUs Ray gave it."""

    node_id: str
    gpu_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class ScriptPaths:
    """Where a script keeps what outlives its processes, as the worker's node sees it."""

    checkpoint_dir: str
    tensorboard_dir: str
    checkpoint_uri: str | None = None  # remote storage only: the job's place there, which the node's directory mirrors


def local_path(uri: str) -> str | None:
    """The path a plain path or file:// URI names; None for remote storage (s3://, gs://, …)."""
    if "://" not in uri:
        return uri
    parsed = urlparse(uri)
    return parsed.path if parsed.scheme == "file" else None


def script_paths(storage_root: str, tensorboard_dir: str, job_id: str) -> ScriptPaths:
    """RINGMASTER_CHECKPOINT_DIR under the job's storage (it survives restarts and attempts); on remote storage a
    directory on each node instead, synced to the storage by the worker (checkpoint_sync.py)."""
    checkpoints = local_path(f"{storage_root}/{SCRIPT_CHECKPOINTS}")
    tensorboard = local_path(f"{tensorboard_dir}/{SCRIPT_TENSORBOARD}")
    node_local = Path(tempfile.gettempdir(), "ringmaster-script", job_id)
    return ScriptPaths(
        checkpoint_dir=checkpoints or str(node_local / SCRIPT_CHECKPOINTS),
        tensorboard_dir=tensorboard or str(node_local / SCRIPT_TENSORBOARD),
        checkpoint_uri=None if checkpoints else f"{storage_root}/{SCRIPT_CHECKPOINTS}",
    )


def environment_for_ranks(
    places: list[RankPlace],
    *,
    master_addr: str,
    master_port: int,
    run_id: str,
    restart_count: int,
    max_restarts: int,
    paths: ScriptPaths,
    omp_num_threads_given: bool,
) -> list[dict[str, str]]:
    """Each rank's variables, in rank order (`places` is): torchrun's for a group of len(places) ranks whose nodes
    are the distinct node ids in order. `omp_num_threads_given`: the job's own env sets OMP_NUM_THREADS (else it is 1
    where a node runs several ranks, as torchrun sets it)."""
    nodes = list(dict.fromkeys(place.node_id for place in places))
    per_node = {node: [place for place in places if place.node_id == node] for node in nodes}
    environments = []
    for rank, place in enumerate(places):
        on_node = per_node[place.node_id]
        local_rank = sum(1 for earlier in places[:rank] if earlier.node_id == place.node_id)
        variables = {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(len(places)),
            "LOCAL_WORLD_SIZE": str(len(on_node)),
            "GROUP_RANK": str(nodes.index(place.node_id)),
            "GROUP_WORLD_SIZE": str(len(nodes)),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(len(places)),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",  # the script's rank 0 hosts the store at MASTER_PORT
            CHECKPOINT_DIR_VARIABLE: paths.checkpoint_dir,
            TENSORBOARD_DIR_VARIABLE: paths.tensorboard_dir,
            HF_TENSORBOARD_DIR_VARIABLE: paths.tensorboard_dir,
            "PYTHONUNBUFFERED": "1",  # each line reaches the log as it is printed, as `torchrun`'s `python -u` does
        }
        if paths.checkpoint_uri is not None:
            variables[CHECKPOINT_URI_VARIABLE] = paths.checkpoint_uri
        if any(other.gpu_ids for other in on_node):
            # Every GPU of the node's ranks, in local-rank order, as torchrun's processes see a node's GPUs: a script's
            # torch.cuda.set_device(LOCAL_RANK) takes its own (with one GPU per worker).
            variables["CUDA_VISIBLE_DEVICES"] = ",".join(gpu for other in on_node for gpu in other.gpu_ids)
        if not omp_num_threads_given and len(on_node) > 1:
            variables["OMP_NUM_THREADS"] = "1"
        environments.append(variables)
    return environments


def process_environment(inherited: dict[str, str], rank_variables: dict[str, str], metrics_file: str) -> dict[str, str]:
    """The process's whole environment: the worker's own (the job's runtime env: its variables, PYTHONPATH with the
    job's code first), then the rank's variables and the file `ringmaster.report` appends to."""
    return {**inherited, **rank_variables, METRICS_FILE_VARIABLE: metrics_file}


def resolved_command(command: list[str], python: str) -> list[str]:
    """`python` or `python3` at the start of a command is the job's own interpreter (its runtime env's), which PATH
    may not name."""
    if command and command[0] in ("python", "python3"):
        return [python, *command[1:]]
    return list(command)


def omp_num_threads_given(runtime_env_vars: dict[str, str]) -> bool:
    """Whether the job's own env sets OMP_NUM_THREADS (Ray sets it in each worker, which does not count)."""
    return "OMP_NUM_THREADS" in runtime_env_vars


def ensure_directories(paths: ScriptPaths) -> None:
    """Create the script's directories on this node (they may exist: from an earlier process, restart or attempt)."""
    for directory in (paths.checkpoint_dir, paths.tensorboard_dir):
        os.makedirs(directory, exist_ok=True)
