"""A script job's controller, in-process against fakes (worker group, bundles, Ray facade, reporter, clock): the
group starts with torchrun's variables, a lost worker stops the survivors and restarts the group at the size the
scaling policy decides with TORCHELASTIC_RESTART_COUNT one higher, and a cancel stops every process with the job's
stop_grace_s. Nothing sleeps: every wait is the fake clock's."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

from ray.exceptions import RayActorError

from ringmaster.service.spec import JobSpec
from ringmaster.workers.driver.bundles import Slot
from ringmaster.workers.driver.script_controller import ScriptController, ScriptPlacing, ScriptRunning
from ringmaster.workers.driver.states import Failed, Finished
from ringmaster.workers.driver.worker_group import RankedWorker, order_ranks


class Call:
    """A remote call's ref: run when made, as Ray starts it; its error (a dead actor's) raised when it is got. Hashable
    by identity, as Ray's refs are keys of the controller's dicts."""

    def __init__(self, actor: FakeScriptWorker, method: str, args: tuple[Any, ...]) -> None:
        self.result: Any = None
        self.error: Exception | None = RayActorError() if actor.dead else None
        if self.error is None:
            self.result = getattr(actor, f"do_{method}")(*args)

    def value(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class _Method:
    def __init__(self, actor: FakeScriptWorker, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any) -> Call:
        return Call(self.actor, self.name, args)


@dataclass(eq=False)
class FakeScriptWorker:
    node_id: str
    dead: bool = False
    runs: list[dict[str, str]] = field(default_factory=list)  # each start's rank variables
    stops: list[float] = field(default_factory=list)  # each stop's grace
    exit_code: int | None = None  # set by a test: the current run's process ended so

    def __getattr__(self, name: str) -> _Method:
        if name in ("start", "poll", "stop", "free_port", "heartbeat"):
            return _Method(self, name)
        raise AttributeError(name)

    def do_start(self, command: list[str], variables: dict[str, str], paths: dict[str, Any], rank: int) -> int:
        self.runs.append(variables)
        self.exit_code = None
        return 1000 + rank

    def do_poll(self) -> dict[str, Any]:
        ended = None
        if self.exit_code is not None:
            ended = {"code": self.exit_code, "at": 0.0, "stopped": False, "start_error": None}
            ended["description"] = f"exited with code {self.exit_code}"
        return {"lines": [], "dropped": 0, "metrics": [], "exit": ended, "stderr_tail": []}

    def do_stop(self, grace_s: float) -> None:
        self.stops.append(grace_s)

    def do_free_port(self) -> int:
        return 29500

    def do_heartbeat(self) -> int:
        return 0


class FakeRay:
    def __init__(self) -> None:
        self.killed: list[Any] = []

    def kill(self, actor: Any) -> None:
        self.killed.append(actor)

    def get(self, ref: Any) -> Any:
        return [one.value() for one in ref] if isinstance(ref, list) else ref.value()

    def wait(self, refs: list[Any], num_returns: int, timeout: float | None) -> tuple[list[Any], list[Any]]:
        return refs, []

    def died_on_a_live_node(self, actor_id: str) -> bool:
        return False


class FakeBundles:
    def __init__(self, nodes: list[str]) -> None:
        self.slots = {Slot("admission", index): node for index, node in enumerate(nodes)}
        self.lost_nodes: set[str] = set()
        self.released = False

    @property
    def admission(self) -> list[Slot]:
        return list(self.slots)

    def spare(self, taken: set[Slot]) -> list[Slot]:
        return [slot for slot, node in self.slots.items() if slot not in taken and node not in self.lost_nodes]

    def spare_capacity(self) -> int:
        return 0

    def release(self) -> None:
        self.released = True


_pids = count(100)


class FakeGroup:
    def __init__(self, bundles: FakeBundles) -> None:
        self.bundles = bundles
        self.workers: list[RankedWorker] = []
        self.removed: list[RankedWorker] = []

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def nodes(self) -> list[str]:
        return sorted({worker.node_id for worker in self.workers})

    def launch(self, slots: list[Slot], timeout_s: float) -> list[RankedWorker]:
        started = []
        for slot in slots:
            node, pid = self.bundles.slots[slot], next(_pids)
            started.append(RankedWorker(FakeScriptWorker(node), slot, node, "10.0.0.1", pid, actor_id=f"actor-{pid}"))
        return started

    def rank(self, members: list[RankedWorker]) -> None:
        self.workers = [members[index] for index in order_ranks([{"node_id": m.node_id} for m in members])]
        for rank, worker in enumerate(self.workers):
            worker.rank = rank

    def unresponsive(
        self, timeout_s: float, grace_s: float, workers: list[RankedWorker] | None = None
    ) -> list[RankedWorker]:
        return [worker for worker in (self.workers if workers is None else workers) if worker.actor.dead]

    def remove(self, lost: list[RankedWorker]) -> None:
        self.removed += lost
        self.workers = [worker for worker in self.workers if worker not in lost]

    def shutdown(self) -> None:
        self.workers = []


class FakeReporter:
    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []
        self.ended = threading.Event()
        self.ended_state: str | None = None
        self.preempting = threading.Event()
        self.preempted_for: str | None = None

    def report(self, **fields: Any) -> int:
        self.reports.append(fields)
        return len(self.reports)

    @property
    def handled_seq(self) -> int:
        return len(self.reports)

    @property
    def states(self) -> list[str]:
        return [report["state"] for report in self.reports if report.get("state")]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _controller(tmp_path: Path, nodes: list[str], minimum: int, maximum: int) -> ScriptController:
    spec = JobSpec.model_validate(
        {
            "name": "script",
            "command": ["python", "train.py"],
            "workers": {"min": minimum, "max": maximum},
            "max_failures": 3,
            "stop_grace_s": 7,
        }
    )
    bundles = FakeBundles(nodes)
    return ScriptController(
        spec,
        "job",
        1,
        str(tmp_path),
        FakeReporter(),
        group=FakeGroup(bundles),
        bundles=bundles,
        ray=FakeRay(),
        clock=FakeClock(),
    )


def _actors(controller: ScriptController) -> list[FakeScriptWorker]:
    return [worker.actor for worker in controller.group.workers]


def test_the_group_starts_with_torchruns_variables_and_succeeds_when_every_rank_exits_zero(tmp_path: Path) -> None:
    controller = _controller(tmp_path, ["node-b", "node-a"], 2, 2)
    running = controller.step(ScriptPlacing(restart_count=0, waiting_since=0.0))
    assert isinstance(running, ScriptRunning)
    first, second = _actors(controller)
    assert (first.node_id, second.node_id) == ("node-a", "node-b"), "ranked node by node"
    assert [run["RANK"] for run in first.runs + second.runs] == ["0", "1"]
    assert {run["MASTER_PORT"] for run in first.runs + second.runs} == {"29500"}
    first.exit_code = 0
    assert controller.step(running) is running
    second.exit_code = 0
    assert controller.step(running) == Finished(succeeded=True)
    assert controller.reporter.states == ["RUNNING", "SUCCEEDED"]


def test_a_lost_worker_restarts_the_group_at_the_size_left_with_the_restart_counted(tmp_path: Path) -> None:
    controller = _controller(tmp_path, ["node-a", "node-b"], 1, 2)
    state = controller.step(ScriptPlacing(restart_count=0, waiting_since=0.0))
    survivor, lost = _actors(controller)
    lost.dead = True
    state = controller.step(state)  # its poll fails: the group restarts
    state = controller.step(state)  # every survivor's process stopped with the job's grace, RECOVERING reported
    assert survivor.stops == [7] and controller.bundles.lost_nodes == {"node-b"}
    assert isinstance(state, ScriptPlacing) and state.restart_count == 1
    state = controller.step(state)
    assert isinstance(state, ScriptRunning) and _actors(controller) == [survivor]
    restarted = survivor.runs[-1]
    assert (restarted["WORLD_SIZE"], restarted["RANK"], restarted["TORCHELASTIC_RESTART_COUNT"]) == ("1", "0", "1")
    assert controller.reporter.states == ["RUNNING", "RECOVERING", "RUNNING"]


def test_a_cancel_stops_every_process_with_the_grace_and_ends_the_attempt(tmp_path: Path) -> None:
    controller = _controller(tmp_path, ["node-a", "node-b"], 2, 2)
    state = controller.step(ScriptPlacing(restart_count=0, waiting_since=0.0))
    controller.reporter.ended.set()
    assert controller.step(state) == Finished(succeeded=False)
    assert [actor.stops for actor in _actors(controller)] == [[7], [7]]


def test_a_preempted_script_is_stopped_with_its_grace_and_the_attempt_ends_preempted(tmp_path: Path) -> None:
    controller = _controller(tmp_path, ["node-a", "node-b"], 2, 2)
    state = controller.step(ScriptPlacing(restart_count=0, waiting_since=0.0))
    controller.reporter.preempted_for = "job-high"
    controller.reporter.preempting.set()
    assert controller.step(state) == Finished(succeeded=False)
    assert [actor.stops for actor in _actors(controller)] == [[7], [7]], "SIGTERM, then stop_grace_s to save"
    assert controller.reporter.states == ["RUNNING", "PREEMPTED"]
    assert controller.reporter.reports[-1]["message"] == (
        "the script was stopped (SIGTERM, then 7 s to save), preempted for job job-high"
    )


def test_a_rank_that_exits_non_zero_fails_the_job_once_and_the_others_are_stopped(tmp_path: Path) -> None:
    controller = _controller(tmp_path, ["node-a", "node-b"], 2, 2)
    state = controller.step(ScriptPlacing(restart_count=0, waiting_since=0.0))
    failing, other = _actors(controller)
    failing.exit_code = 2
    failed = controller.step(state)
    assert isinstance(failed, Failed) and failed.reason.startswith("rank 0 exited with code 2 (node node-a")
    assert other.stops == [7]
