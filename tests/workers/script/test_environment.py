"""The environment a script's rank gets: torchrun's variables for a group ranked node by node, the GPUs of a node's
ranks, and where its checkpoints go on local and remote storage."""

from __future__ import annotations

from ringmaster.workers.script.environment import (
    RankPlace,
    ScriptPaths,
    environment_for_ranks,
    resolved_command,
    script_paths,
)

PATHS = ScriptPaths(checkpoint_dir="/storage/job/checkpoints", tensorboard_dir="/storage/job/tensorboard/a1/script")


def _environments(places: list[RankPlace], omp_given: bool = False) -> list[dict[str, str]]:
    return environment_for_ranks(
        places,
        master_addr="10.0.0.1",
        master_port=29500,
        run_id="job",
        restart_count=2,
        max_restarts=3,
        paths=PATHS,
        omp_num_threads_given=omp_given,
    )


def test_three_ranks_on_two_nodes_get_torchruns_variables() -> None:
    first = _environments([RankPlace("a"), RankPlace("a"), RankPlace("b")])
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) for e in first] == [
        ("0", "0", "2", "0"),
        ("1", "1", "2", "0"),
        ("2", "0", "1", "1"),
    ]
    for rank, variables in enumerate(first):
        assert variables["ROLE_RANK"] == str(rank)
        assert variables["WORLD_SIZE"] == variables["ROLE_WORLD_SIZE"] == "3"
        assert variables["GROUP_WORLD_SIZE"] == "2"
        assert (variables["MASTER_ADDR"], variables["MASTER_PORT"]) == ("10.0.0.1", "29500")
        assert variables["TORCHELASTIC_RESTART_COUNT"] == "2" and variables["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert variables["TORCHELASTIC_RUN_ID"] == "job"
        assert variables["RINGMASTER_CHECKPOINT_DIR"] == "/storage/job/checkpoints"
        assert variables["RINGMASTER_TENSORBOARD_DIR"] == variables["TENSORBOARD_LOGGING_DIR"]
        assert "CUDA_VISIBLE_DEVICES" not in variables
    # torchrun sets one OpenMP thread where a node runs several ranks, unless the job's env sets its own.
    assert [variables.get("OMP_NUM_THREADS") for variables in first] == ["1", "1", None]
    assert all("OMP_NUM_THREADS" not in e for e in _environments([RankPlace("a"), RankPlace("a")], omp_given=True))


def test_a_nodes_ranks_see_its_gpus_in_local_rank_order() -> None:
    environments = _environments([RankPlace("a", ("3",)), RankPlace("a", ("1",)), RankPlace("b", ("0",))])
    assert [e["CUDA_VISIBLE_DEVICES"] for e in environments] == ["3,1", "3,1", "0"]


def test_checkpoints_lie_under_local_storage_and_on_the_node_for_remote_storage() -> None:
    local = script_paths("file:///data/ckpt/job", "file:///data/ckpt/job/tensorboard/attempt-1", "job")
    assert local == ScriptPaths("/data/ckpt/job/checkpoints", "/data/ckpt/job/tensorboard/attempt-1/script")
    remote = script_paths("s3://bucket/plane/job", "s3://bucket/plane/job/tensorboard/attempt-1", "job")
    assert remote.checkpoint_uri == "s3://bucket/plane/job/checkpoints"
    assert remote.checkpoint_dir.endswith("/ringmaster-script/job/checkpoints")


def test_python_is_the_jobs_own_interpreter() -> None:
    assert resolved_command(["python", "train.py"], "/venv/bin/python") == ["/venv/bin/python", "train.py"]
    assert resolved_command(["bash", "run.sh"], "/venv/bin/python") == ["bash", "run.sh"]
