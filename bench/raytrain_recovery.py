"""Ray Train's side of bench/recovery.py: how long Ray Train (V2) takes from a node's death to the
first completed training step afterwards, on a SimulatedCluster, training tiny-gpt on pysource.

    python bench/raytrain_recovery.py [--scenarios replace shrink] [--rounds 1] [--kill-after-step 30]

Prints one JSON line per measurement. Importable: ``measure_ray_train(cluster, scenario, storage_dir)``.

How it measures
- ``TorchTrainer`` (gloo DDP, one CPU per worker) with ``FailureConfig(max_failures=3)`` and a
  checkpoint (``torch.save`` of model + optimizer + step, through ``ray.train.report``) every
  ``checkpoint_every`` steps; restore with ``ray.train.get_checkpoint()``.
  * "replace": ``ScalingConfig(num_workers=2)``. Once training has passed ``kill_after_step`` the
    harness adds a replacement node (and waits for it), then kills the node of worker ``victim_rank``.
  * "replace-elastic": as "replace", with ``ScalingConfig(num_workers=(1, 2))`` (V2 elasticity).
  * "shrink": ``ScalingConfig(num_workers=(1, 2))`` (V2 elasticity); the worker's node is killed and
    nothing replaces it, so the group can only restart on the survivor. The cluster must then have
    no spare CPU node, or Ray Train would simply restart at 2 workers on it.
- ``trainer.fit()`` runs in a driver subprocess of the calling process (so a hung run can be ended by
  killing that process, which takes its Ray Train controller and workers with it); the kill is done
  by the calling process's main thread through ``SimulatedCluster.kill_node``.
- Every worker appends a JSON line per completed step (wall clock, step, rank, world size, node id,
  pid and the wall-clock start of its train-function incarnation) to a file under ``storage_dir``.
  recovery_s = (first step completed by an incarnation started after the kill) - (kill time),
  all ``time.time()`` on one machine. A controller callback logs Ray Train's state transitions
  (RUNNING -> RESTARTING -> SCHEDULING -> RUNNING ...) for the breakdown in ``detail``.
- Ray Train's own knobs are left at their defaults (health-check poll 2 s, worker-group start
  timeout 60 s, elastic resize monitor 60 s); Ray core's node health checks are whatever the cluster
  was started with (SimulatedCluster tightens them as ringmaster's head does).
- After a restore the run trains ``steps_after_restore`` more steps and ends, so it finishes soon
  after recovery; ``steps`` only bounds a run that is never interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SCENARIOS = ("replace", "replace-elastic", "shrink")
_FIT_FLAG = "--_fit-driver"


# --------------------------------------------------------------------------- worker side


class _StepLog:
    """A worker's JSON-lines record of its steps, each line naming the worker, its node and its incarnation."""

    def __init__(self, path: str, incarnation: float) -> None:
        import ray
        import ray.train

        context = ray.train.get_context()
        self.rank, self.world = context.get_world_rank(), context.get_world_size()
        self._fields = {
            "rank": self.rank,
            "world": self.world,
            "node": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "inc": incarnation,
        }
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - written until the actor exits

    def emit(self, **record: Any) -> None:
        self._file.write(json.dumps({**record, **self._fields}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _train_loop(config: dict) -> None:
    """The per-worker training function: tiny-gpt DDP over gloo, one CPU thread."""
    import time as _time

    incarnation = _time.time()
    import tempfile as _tempfile
    from contextlib import nullcontext

    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.nn.functional as F

    from ringmaster.workers.data.pysource import pysource_splits
    from ringmaster.workers.models.tiny_gpt import TinyGPT, TinyGPTConfig

    torch.set_num_threads(1)
    log = _StepLog(config["step_log"], incarnation)
    rank, world, emit = log.rank, log.world, log.emit
    emit(event="start", t=incarnation)
    emit(event="imported", t=_time.time())
    torch.manual_seed(config["seed"])
    model_config = TinyGPTConfig()
    model = TinyGPT(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    train_dataset, _ = pysource_splits(seq_len=model_config.seq_len)

    start_step, stop_at = 0, config["steps"]
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = torch.load(Path(directory) / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step = state["step"]
        stop_at = min(config["steps"], start_step + config["steps_after_restore"])
        emit(event="restored", t=_time.time(), step=start_step)
    model = ray.train.torch.prepare_model(model)  # DistributedDataParallel (gloo) when world > 1

    global_batch, micro = config["global_batch_size"], config["micro_batch_size"]
    if global_batch % (micro * world):
        raise ValueError(f"global batch {global_batch} is not a multiple of micro batch {micro} x world {world}")
    emit(event="ready", t=_time.time(), step=start_step)
    for step in range(start_step, stop_at):
        # The step's global batch depends only on (seed, step), so any world size resumes exactly.
        generator = torch.Generator().manual_seed(config["seed"] * 1_000_003 + step)
        mine = torch.randint(len(train_dataset), (global_batch,), generator=generator)[rank::world]
        chunks = mine.split(micro)
        loss_sum = 0.0
        for index, chunk in enumerate(chunks):
            inputs, targets = (torch.stack(part) for part in zip(*(train_dataset[int(i)] for i in chunk)))
            sync = index == len(chunks) - 1 or world == 1
            with model.no_sync() if not sync else nullcontext():
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
                (loss / len(chunks)).backward()
            loss_sum += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        emit(event="step", t=_time.time(), step=done, loss=loss_sum / len(chunks))
        if done % config["checkpoint_every"] == 0 or done == stop_at:
            with _tempfile.TemporaryDirectory() as directory:
                saved = None
                if rank == 0:
                    raw = model.module if hasattr(model, "module") else model
                    torch.save(
                        {"model": raw.state_dict(), "optimizer": optimizer.state_dict(), "step": done},
                        Path(directory) / "state.pt",
                    )
                    saved = ray.train.Checkpoint.from_directory(directory)
                ray.train.report({"step": done, "loss": loss_sum / len(chunks)}, checkpoint=saved)
    emit(event="end", t=_time.time(), step=stop_at)
    log.close()


def _torchft_train_loop(config: dict) -> None:
    """torchft's way (its Manager, process group, DDP and optimizer wrappers, sampler and step counter, as torchft's
    Ray Train example writes it): every worker is a replica group of one; a lost replica's peers train on, and its
    replacement heals from a live peer. Logs each committed step with the sample ids it trained on."""
    import time as _time

    incarnation = _time.time()
    from datetime import timedelta

    import torch
    import torch.nn.functional as F
    from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    from ringmaster.workers.data.pysource import pysource_splits
    from ringmaster.workers.models.tiny_gpt import TinyGPT, TinyGPTConfig

    torch.set_num_threads(1)
    log = _StepLog(config["step_log"], incarnation)
    rank, world, emit = log.rank, log.world, log.emit
    emit(event="start", t=incarnation)
    torch.manual_seed(config["seed"])
    model_config = TinyGPTConfig()
    model = TinyGPT(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    corpus, _ = pysource_splits(seq_len=model_config.seq_len)
    dataset = _WithIds(corpus, config["samples"])

    process_group = ProcessGroupGloo(timeout=timedelta(seconds=30))
    manager = Manager(
        pg=process_group,
        min_replica_size=1,
        load_state_dict=lambda state: (
            model.load_state_dict(state["model"]),
            optimizer.load_state_dict(state["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        world_size=1,
        rank=0,
        replica_id=f"bench_{rank}",
        timeout=timedelta(seconds=60),
        checkpoint_transport=PGTransport(process_group, timeout=timedelta(seconds=30), device=torch.device("cpu")),
    )
    ddp_model = DistributedDataParallel(manager, model)
    ft_optimizer = Optimizer(manager, optimizer)
    # Each replica reads its own shard of the epoch, as torchft's sampler gives it.
    sampler = DistributedSampler(
        dataset,
        replica_rank=rank,
        num_replica_groups=world,
        group_rank=0,
        num_replicas=1,
        shuffle=True,
        seed=config["seed"],
    )
    batches = iter(
        torch.utils.data.DataLoader(
            dataset, batch_size=config["global_batch_size"] // world, sampler=sampler, drop_last=True
        )
    )
    emit(event="ready", t=_time.time(), step=manager.current_step())
    while manager.current_step() < config["steps"]:
        try:
            ids, inputs, targets = next(batches)
        except StopIteration:
            break  # this replica's shard of the epoch is used up
        before, began = manager.current_step(), _time.monotonic()
        ft_optimizer.zero_grad()
        loss = F.cross_entropy(ddp_model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        ft_optimizer.step()
        _time.sleep(max(0.0, config["min_step_s"] - (_time.monotonic() - began)))  # paced: the epoch outlasts a heal
        if manager.current_step() > before:  # committed: every live replica applied it
            emit(event="step", t=_time.time(), step=manager.current_step(), loss=loss.item(), ids=ids.tolist())
    emit(event="end", t=_time.time(), step=manager.current_step())
    manager.shutdown()
    log.close()


class _WithIds:
    """The first `count` samples of a dataset, each with its index (the sample's id)."""

    def __init__(self, dataset, count: int) -> None:
        self.dataset, self.count = dataset, min(count, len(dataset))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        return (index, *self.dataset[index])


# --------------------------------------------------------------------------- driver subprocess


def _fit_driver(config_path: str) -> None:
    """Runs in the subprocess: connect to the cluster, build the TorchTrainer, fit, write the outcome."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.execution.callback import ControllerCallback

    config = json.loads(Path(config_path).read_text())
    events_path = config["controller_log"]

    class StateLog(ControllerCallback):
        """Logs Ray Train controller state transitions with wall-clock times (runs in the controller)."""

        def after_controller_state_update(self, previous_state, current_state) -> None:
            record = {"t": time.time(), "from": type(previous_state).__name__, "to": type(current_state).__name__}
            for attribute in ("num_workers", "scaling_decision", "failure_decision", "training_failed_error"):
                value = getattr(current_state, attribute, None)
                if value is not None:
                    record[attribute] = str(value)[:300]
            with open(events_path, "a") as events:
                events.write(json.dumps(record) + "\n")

    ray.init(address=config["address"], log_to_driver=False)
    outcome: dict[str, Any] = {"driver_node": ray.get_runtime_context().get_node_id()}
    workers = config["num_workers"]
    trainer = TorchTrainer(
        _torchft_train_loop if config["torchft"] else _train_loop,
        train_loop_config=config,
        torch_config=_torchft_config() if config["torchft"] else None,
        scaling_config=ScalingConfig(
            num_workers=tuple(workers) if isinstance(workers, list) else workers,
            use_gpu=False,
            resources_per_worker={"CPU": 1},
        ),
        run_config=RunConfig(
            name=config["run_name"],
            storage_path=config["storage_path"],
            failure_config=FailureConfig(max_failures=config["max_failures"]),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            callbacks=[StateLog()],
        ),
    )
    started = time.time()
    try:
        result = trainer.fit()
        outcome.update(
            ok=result.error is None,
            error=None if result.error is None else repr(result.error)[:2000],
            metrics=result.metrics,
        )
    except Exception as error:
        outcome.update(ok=False, error=repr(error)[:2000])
    outcome["fit_s"] = time.time() - started
    Path(config["outcome"]).write_text(json.dumps(outcome, default=str))
    ray.shutdown()


def _torchft_config():
    """Ray Train's TorchftConfig, whose lighthouse actor asks for no CPU: Ray Train pins it to the driver's node, the
    simulated cluster's head, which has none (on a real cluster it would take a CPU there)."""
    import ray
    from ray.train.v2.torch import torchft_config
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    class Backend(torchft_config._TorchftBackend):
        def _maybe_create_lighthouse_actor(self, backend_config) -> str:
            if self.lighthouse_actor is None:
                self.lighthouse_actor = torchft_config.LighthouseServerActor.options(
                    num_cpus=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(
                        ray.get_runtime_context().get_node_id(), soft=False
                    ),
                ).remote(lighthouse_kwargs={"bind": "[::]:0", **backend_config.lighthouse_kwargs})
            return ray.get(self.lighthouse_actor.address.remote())

    class Config(torchft_config.TorchftConfig):
        @property
        def backend_cls(self):
            return Backend

    return Config(lighthouse_kwargs={"min_replicas": 1}, backend="gloo")


# --------------------------------------------------------------------------- harness (calling process)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            pass
    return records


def _stop_driver(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def measure_ray_train(
    cluster,
    scenario: str,
    storage_dir: Path,
    steps: int = 2000,
    kill_after_step: int = 30,
    checkpoint_every: int = 10,
    steps_after_restore: int = 20,
    victim_rank: int = 1,
    global_batch_size: int = 16,
    micro_batch_size: int = 4,
    lr: float = 1e-3,
    seed: int = 0,
    max_failures: int = 3,
    timeout_s: float = 420.0,
    torchft: bool = False,
    epoch_steps: int = 800,
    min_step_s: float = 0.05,
) -> dict:
    """Kill a training worker's node mid-run and time Ray Train's recovery.

    ``torchft``: Ray Train with TorchftConfig and torchft's loop (_torchft_train_loop) on 2 replica groups of one
    worker, training exactly one epoch of ``epoch_steps`` global batches, each step paced to at least ``min_step_s`` (so
    that the epoch outlasts the replacement's heal); besides the times, the samples of that epoch
    its committed steps repeated or never used (from the ids every step logged). Measured in "replace" only: its
    survivor's pause is what a shrink would cost, and its replacement's heal what a replace costs.

    ``cluster`` is a harness.simulated_cluster.SimulatedCluster with at least 2 one-CPU worker nodes
    (exactly 2 for "shrink", so that no spare capacity turns the shrink into a restart at full size).
    Returns {"scenario", "recovery_s", "detail"}; recovery_s is None, with detail["reason"], when the
    scenario could not be measured or Ray Train did not recover.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")
    storage_dir = Path(storage_dir).resolve()
    storage_dir.mkdir(parents=True, exist_ok=True)
    nodes_before = len(cluster.cluster.worker_nodes)
    detail: dict[str, Any] = {"worker_nodes_before": nodes_before}
    if nodes_before < 2:
        return {"scenario": scenario, "recovery_s": None, "detail": {**detail, "reason": "needs 2 worker nodes"}}
    if torchft and scenario != "replace":
        return {
            "scenario": scenario,
            "recovery_s": None,
            "detail": {**detail, "reason": "torchft is measured in replace"},
        }
    if scenario == "shrink" and nodes_before != 2:
        return {
            "scenario": scenario,
            "recovery_s": None,
            "detail": {**detail, "reason": "shrink needs exactly 2 worker nodes (no spare capacity)"},
        }

    try:
        from ray.train.v2._internal.constants import is_v2_enabled
        from ray.train.v2.api.config import ScalingConfig as ScalingConfigV2

        ScalingConfigV2(num_workers=(1, 2))  # elasticity is validated here in V2
        if not is_v2_enabled():
            raise RuntimeError("RAY_TRAIN_V2_ENABLED is off")
    except Exception as error:
        if scenario != "replace":
            return {
                "scenario": scenario,
                "recovery_s": None,
                "detail": {**detail, "reason": f"elastic num_workers=(1, 2) unsupported: {error!r}"},
            }

    run_name = f"{'torchft' if torchft else 'raytrain'}-{scenario}-{time.strftime('%H%M%S')}-{os.getpid()}"
    run_dir = storage_dir / run_name
    run_dir.mkdir()
    step_log, controller_log = run_dir / "steps.jsonl", run_dir / "controller.jsonl"
    config = {
        "address": cluster.gcs_address,
        "run_name": run_name,
        "storage_path": str(storage_dir / "ray_results"),
        "num_workers": 2 if scenario == "replace" or torchft else [1, 2],
        "max_failures": max_failures,
        "torchft": torchft,
        "samples": epoch_steps * global_batch_size,
        "min_step_s": min_step_s,
        "steps": epoch_steps if torchft else steps,
        "steps_after_restore": steps_after_restore,
        "checkpoint_every": checkpoint_every,
        "global_batch_size": global_batch_size,
        "micro_batch_size": micro_batch_size,
        "lr": lr,
        "seed": seed,
        "step_log": str(step_log),
        "controller_log": str(controller_log),
        "outcome": str(run_dir / "outcome.json"),
    }
    (run_dir / "config.json").write_text(json.dumps(config))
    env = dict(os.environ, RAY_TRAIN_V2_ENABLED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    with open(run_dir / "driver.log", "wb") as driver_log:
        driver = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), _FIT_FLAG, str(run_dir / "config.json")],
            cwd=REPO,
            env=env,
            stdout=driver_log,
            stderr=subprocess.STDOUT,
        )
    launched = time.time()
    kill_time = None
    try:
        # Wait for training to pass kill_after_step, then (replace) add a node and kill a worker's node.
        victim_node = None
        while kill_time is None:
            if driver.poll() is not None:
                break
            if time.time() - launched > timeout_s:
                break
            records = _read_jsonl(step_log)
            progress = [r for r in records if r["event"] == "step"]
            if progress and max(r["step"] for r in progress) >= kill_after_step:
                group = {r["rank"]: r["node"] for r in sorted(records, key=lambda r: r["t"])}  # latest per rank
                victim_node = group.get(victim_rank, group[0])
                detail["group_before"] = {str(rank): node for rank, node in sorted(group.items())}
                detail["step_s_before_kill"] = _median_step_seconds(progress)
                if scenario in ("replace", "replace-elastic"):
                    added_at = time.time()
                    replacement = cluster.add_node()
                    detail["replacement_node"] = replacement.node_id
                    detail["add_node_s"] = round(time.time() - added_at, 2)
                records = _read_jsonl(step_log)
                detail["step_at_kill"] = max(r["step"] for r in records if r["event"] == "step")
                node = cluster.node_by_id(victim_node)
                kill_time = time.time()
                cluster.kill_node(node)
                detail["victim_node"] = victim_node
                detail["victim_rank"] = victim_rank
                break
            time.sleep(0.05)
        if kill_time is None:
            _stop_driver(driver)
            reason = (
                "training ended before the kill" if driver.returncode == 0 else "no kill: driver exited or timed out"
            )
            return {
                "scenario": scenario,
                "recovery_s": None,
                "detail": {**detail, "reason": reason, "run_dir": str(run_dir), **_outcome(run_dir)},
            }

        # Wait for the run to recover and finish (or give up).
        deadline = kill_time + timeout_s
        while driver.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        timed_out = driver.poll() is None
        _stop_driver(driver)
    except BaseException:
        _stop_driver(driver)
        raise

    records = _read_jsonl(step_log)
    after = [r for r in records if r["inc"] > kill_time]
    first_step = min((r for r in after if r["event"] == "step"), key=lambda r: r["t"], default=None)
    first_of = lambda event: min((r["t"] for r in after if r["event"] == event), default=None)  # noqa: E731
    rel = lambda t: None if t is None else round(t - kill_time, 3)  # noqa: E731
    old_steps_after_kill = [r for r in records if r["inc"] <= kill_time and r["event"] == "step" and r["t"] > kill_time]
    detail.update(
        run_dir=str(run_dir),
        timed_out=timed_out,
        worker_started_s=rel(first_of("start")),
        imported_s=rel(first_of("imported")),
        restored_s=rel(first_of("restored")),
        ready_s=rel(first_of("ready")),
        restored_step=next((r["step"] for r in after if r["event"] == "restored"), None),
        world_size_after=first_step["world"] if first_step else None,
        nodes_after=sorted({r["node"] for r in after}),
        old_group_steps_after_kill=len(old_steps_after_kill),
        controller_states=_state_changes(_read_jsonl(controller_log), kill_time),
        **_outcome(run_dir),
    )
    if first_step is None and not torchft:
        detail["reason"] = "no training step completed after the kill" + (" (timed out)" if timed_out else "")
        return {"scenario": scenario, "recovery_s": None, "steps_redone": None, "detail": detail}
    # The newest step the old incarnation completed (one in flight at the kill may still have ended) minus the step
    # its successor restored (0: no checkpoint yet).
    last_before = max(
        r["step"] for r in records if r["inc"] <= kill_time and r["event"] == "step" and r["t"] <= kill_time
    )
    if not torchft:
        steps_redone = max(0, last_before - (detail["restored_step"] or 0))
        return {
            "scenario": scenario,
            "recovery_s": round(first_step["t"] - kill_time, 3),
            "steps_redone": steps_redone,
            "detail": detail,
        }
    # torchft: the survivor trains on after a pause; the replacement heals from it (its first committed step). Steps
    # are the replicas' shared count: a step numbered at or below the newest one committed before the kill, committed
    # again after it, was redone.
    committed = [r for r in records if r["event"] == "step"]
    # The survivor's stall: the longest gap between its committed steps from its last one before the kill on (a step
    # whose all-reduce had ended before the kill may still commit just after it); recovery_s is the kill to its end.
    # A survivor that committed nothing after the kill was restarted too: then the first step anyone committed ends it.
    survivor = sorted(r["t"] for r in committed if r["inc"] <= kill_time and r["rank"] != victim_rank)
    survivor = [t for t in survivor if t >= max([t for t in survivor if t <= kill_time], default=kill_time)]
    gaps = [(later - earlier, later) for earlier, later in pairwise(survivor)]
    detail["survivor_restarted"] = not gaps
    stall_end = max(gaps)[1] if gaps else min((r["t"] for r in committed if r["t"] > kill_time), default=None)
    resumed = next((r for r in committed if r["t"] == stall_end), None)
    uses = Counter(sample for record in committed for sample in record["ids"])
    detail["samples"] = {
        "of": config["samples"],
        "repeated": sum(uses.values()) - len(uses),
        "never_used": config["samples"] - len(uses),
        "last_step": max((r["step"] for r in committed), default=None),
    }
    detail["survivor_longest_gap_s"] = round(max(gaps)[0], 3) if gaps else None
    return {
        "scenario": scenario,
        "recovery_s": None if resumed is None else round(resumed["t"] - kill_time, 3),
        "heal_s": None if first_step is None else round(first_step["t"] - kill_time, 3),
        "steps_redone": None if resumed is None else max(0, last_before - resumed["step"] + 1),
        "samples_repeated": detail["samples"]["repeated"],
        "samples_never_used": detail["samples"]["never_used"],
        "survivor_restarted": detail["survivor_restarted"],
        "detail": detail,
    }


def _median_step_seconds(progress: list[dict]) -> float | None:
    times = sorted({r["step"]: r["t"] for r in progress if r["rank"] == 0}.items())
    gaps = sorted(b[1] - a[1] for a, b in pairwise(times) if b[0] == a[0] + 1)
    return round(gaps[len(gaps) // 2], 4) if gaps else None


def _state_changes(events: list[dict], since: float) -> list[dict]:
    """Ray Train controller state changes after `since` (seconds relative to it); repeats left out."""
    changes = []
    for event in events:
        if event["t"] >= since and event["to"] != event["from"]:
            change = {"s": round(event["t"] - since, 3), "to": event["to"].removesuffix("State")}
            if "scaling_decision" in event:
                change["decision"] = event["scaling_decision"]
            if "training_failed_error" in event:
                change["failure"] = " ".join(event["training_failed_error"].split())[:200]
            changes.append(change)
    return changes


def _outcome(run_dir: Path) -> dict:
    path = run_dir / "outcome.json"
    if not path.exists():
        return {"fit_ok": False, "fit_error": "driver wrote no outcome (see driver.log)"}
    outcome = json.loads(path.read_text())
    return {
        "fit_ok": outcome.get("ok"),
        "fit_error": outcome.get("error"),
        "fit_s": round(outcome.get("fit_s", 0), 1),
        "final_metrics": outcome.get("metrics"),
    }


# --------------------------------------------------------------------------- CLI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--kill-after-step", type=int, default=30)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--steps-after-restore", type=int, default=20)
    parser.add_argument("--storage-dir", type=Path, default=None, help="default: a temporary directory, removed after")
    parser.add_argument("--keep", action="store_true", help="print the run directories and keep them")
    parser.add_argument(
        "--torchft", action="store_true", help="Ray Train with TorchftConfig and torchft's training loop"
    )
    args = parser.parse_args()

    from harness.simulated_cluster import SimulatedCluster

    with tempfile.TemporaryDirectory(prefix="raytrain-recovery-") as scratch:
        storage = args.storage_dir or Path(scratch)
        cluster = SimulatedCluster(nodes=2)
        try:
            for _ in range(args.rounds):
                for scenario in args.scenarios:
                    # replace ends with 2 nodes (one added, one killed); shrink ends with 1: top up to 2.
                    while len(cluster.cluster.worker_nodes) < 2:
                        cluster.add_node()
                    result = measure_ray_train(
                        cluster,
                        scenario,
                        storage,
                        kill_after_step=args.kill_after_step,
                        checkpoint_every=args.checkpoint_every,
                        steps_after_restore=args.steps_after_restore,
                        torchft=args.torchft,
                    )
                    if not args.keep:
                        result["detail"].pop("run_dir", None)
                    print(json.dumps(result), flush=True)
        finally:
            cluster.shutdown()
        if args.keep and args.storage_dir is None:
            print(json.dumps({"note": "--keep needs --storage-dir; the temporary directory was removed"}))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == _FIT_FLAG:
        _fit_driver(sys.argv[2])
    else:
        main()
