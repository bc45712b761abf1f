"""The job driver's controller, one transition at a time, in-process: a fake worker group, fake bundles, a fake standby
pool, a fake poll, a fake Ray facade, a fake reporter and a fake clock (as Ray Train's controller tests do). No Ray
cluster, and nothing sleeps: every wait is the fake clock's."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import pytest
from ray.exceptions import RayActorError

from ringmaster.service.spec import JobSpec, WorkersSpec
from ringmaster.workers.driver.bundles import Slot
from ringmaster.workers.driver.controller import (
    CAPACITY_LOOK_S,
    CAPACITY_WAIT_S,
    COLLECTIVE_TIMEOUT_S,
    REPLACEMENT_POLL_S,
    REPLACEMENT_WAIT_S,
    Controller,
)
from ringmaster.workers.driver.policies import FormGroup, GiveUp, ScalingPolicy, WaitForCapacity
from ringmaster.workers.driver.poll import PollResult
from ringmaster.workers.driver.states import (
    Failed,
    Finished,
    Placing,
    Recovering,
    Resizing,
    Running,
    Starting,
    State,
)
from ringmaster.workers.driver.worker_group import RankedWorker

ADMISSION = "admission"  # the fake placement group the dispatcher reserved
RESERVED = "reserved"  # ... and one reserved later on idle capacity


# -- fakes ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FakeRef:
    value: Any


class FakeMethod:
    """An actor method: `.remote(...)` records the call and returns a ref to `answer`."""

    def __init__(self, answer: Any = None) -> None:
        self.answer = answer
        self.calls: list[tuple[Any, ...]] = []

    def remote(self, *args: Any) -> FakeRef:
        self.calls.append(args)
        return FakeRef(self.answer)


class FakeActor:
    def __init__(self, name: str) -> None:
        self.name = name
        self.resume_step = FakeMethod(answer=20)  # the durable checkpoint's step rank 0 resumes from

    def __repr__(self) -> str:
        return f"FakeActor({self.name})"


_pids = count(100)


def _worker(slot: Slot, node_id: str) -> RankedWorker:
    pid = next(_pids)
    return RankedWorker(FakeActor(f"w{pid}"), slot, node_id=node_id, ip="10.0.0.1", pid=pid, actor_id=f"actor-{pid}")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class FakeRay:
    def __init__(self) -> None:
        self.killed: list[Any] = []
        self.got: list[FakeRef] = []
        self.process_deaths: set[str] = set()  # actor ids Ray recorded dead of their own process, their node alive

    def kill(self, actor: Any) -> None:
        self.killed.append(actor)

    def get(self, ref: FakeRef) -> Any:
        self.got.append(ref)
        return ref.value

    def wait(self, refs: list[Any], num_returns: int, timeout: float | None) -> tuple[list[Any], list[Any]]:
        raise AssertionError("the controller waits through its group and its poll, not on Ray")

    def died_on_a_live_node(self, actor_id: str) -> bool:
        return actor_id in self.process_deaths


class FakeBundles:
    """Admitted slots, each on a node of its own unless told; `spare` is every free slot on a live node."""

    def __init__(self, admitted: int, nodes: dict[int, str] | None = None) -> None:
        self.slots = [Slot(ADMISSION, index) for index in range(admitted)]  # type: ignore[arg-type]
        self.node = {slot: (nodes or {}).get(slot.index, f"node-{slot.index}") for slot in self.slots}
        self.lost_nodes: set[str] = set()
        self.capacity = 0
        self.looks = 0
        self.moves: dict[int, tuple[Slot, str]] = {}  # at look n, Ray places the slot's bundle on another node
        self.released = False

    @property
    def admission(self) -> list[Slot]:
        return [slot for slot in self.slots if slot.group == ADMISSION]

    def add(self, node_id: str) -> Slot:
        slot = Slot(RESERVED, len(self.slots))  # type: ignore[arg-type]
        self.slots.append(slot)
        self.node[slot] = node_id
        return slot

    def spare(self, taken: set[Slot]) -> list[Slot]:
        self.looks += 1
        if self.looks in self.moves:
            slot, node_id = self.moves[self.looks]
            self.node[slot] = node_id
        return [slot for slot in self.slots if slot not in taken and self.node[slot] not in self.lost_nodes]

    def spare_capacity(self) -> int:
        return self.capacity

    def release(self) -> None:
        self.released = True


class FakeGroup:
    def __init__(self, bundles: FakeBundles) -> None:
        self._bundles = bundles
        self.workers: list[RankedWorker] = []
        self.generation = 0
        self.pooled_started = 0
        self.launched: list[list[Slot]] = []
        self.not_starting: set[Slot] = set()  # slots whose worker does not start in time
        self.formed: list[list[RankedWorker]] = []
        self.lost_while_forming: set[str] = set()  # nodes the next formation loses (its join raises)
        self.silent: list[RankedWorker] = []  # those a probe finds lost
        self.probed: list[list[RankedWorker] | None] = []
        self.inventories: list[list[dict[str, Any]]] = []
        self.trained: list[dict[str, int] | None] = []
        self.removed: list[list[RankedWorker]] = []
        self.stop_requests = 0
        self.shut_down = False

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def nodes(self) -> list[str]:
        return sorted({worker.node_id for worker in self.workers})

    def launch(self, slots: list[Slot], timeout_s: float) -> list[RankedWorker]:
        self.launched.append(list(slots))
        return [_worker(slot, self._bundles.node[slot]) for slot in slots if slot not in self.not_starting]

    def form(self, members: list[RankedWorker]) -> None:
        self.formed.append(list(members))
        self.workers = sorted(members, key=lambda worker: worker.node_id)
        for rank, worker in enumerate(self.workers):
            worker.rank = rank
        self.generation += 1
        if self.lost_while_forming:
            self.silent = [worker for worker in members if worker.node_id in self.lost_while_forming]
            self.lost_while_forming = set()
            raise RayActorError()

    def train(
        self,
        job_id: str,
        storage_root: str,
        resume_from_root: str | None = None,
        attempt: int = 1,
        resume_snapshot: dict[str, int] | None = None,
    ) -> dict[Any, RankedWorker]:
        self.trained.append(resume_snapshot)
        return {f"train-g{self.generation}-r{worker.rank}": worker for worker in self.workers}

    def snapshot_inventories(self, job_id: str) -> list[list[dict[str, Any]]]:
        return self.inventories

    def unresponsive(
        self, timeout_s: float, grace_s: float, workers: list[RankedWorker] | None = None
    ) -> list[RankedWorker]:
        self.probed.append(workers)
        return [worker for worker in (self.workers if workers is None else workers) if worker in self.silent]

    def remove(self, lost: list[RankedWorker]) -> None:
        self.removed.append(list(lost))
        self.workers = [worker for worker in self.workers if worker not in lost]

    def request_stop(self) -> None:
        self.stop_requests += 1

    def shutdown(self) -> None:
        self.shut_down = True
        self.workers = []


class FakeStandby:
    """Warm workers: those warming become ready at the next look (top_up) or wait."""

    def __init__(self) -> None:
        self.ready: list[RankedWorker] = []
        self.warming: list[RankedWorker] = []
        self.wanted: list[int] = []
        self.waited_for_starting = 0
        self.shut_down = False

    @property
    def starting(self) -> int:
        return len(self.warming)

    @property
    def slots(self) -> list[Slot]:
        return [worker.slot for worker in self.ready + self.warming]

    def top_up(self, wanted: int, taken: set[Slot]) -> list[RankedWorker]:
        self.wanted.append(wanted)
        became_ready, self.warming = self.warming, []
        self.ready += became_ready
        return became_ready

    def wait_for_starting(self, timeout_s: float) -> None:
        self.waited_for_starting += 1
        self.ready, self.warming = self.ready + self.warming, []

    def take(self, count: int, timeout_s: float) -> list[RankedWorker]:
        taken, self.ready = self.ready[:count], self.ready[count:]
        return taken

    def shutdown(self) -> None:
        self.shut_down = True


class FakeReporter:
    def __init__(self) -> None:
        self.ended = threading.Event()
        self.ended_state: str | None = None
        self.preempting = threading.Event()
        self.preempted_for: str | None = None
        self.handled_seq = 0
        self.reports: list[dict[str, Any]] = []

    def report(self, **report: Any) -> int:
        self.reports.append(report)
        return len(self.reports)

    @property
    def states(self) -> list[str]:
        return [report["state"] for report in self.reports if report["state"]]

    def end(self, state: str) -> None:
        """The control plane answers that it no longer takes this attempt's reports."""
        self.ended_state = state
        self.ended.set()

    def preempt(self, for_job: str | None) -> None:
        """The control plane answers that this attempt is preempted."""
        self.preempted_for = for_job
        self.preempting.set()


class FakePoll:
    """One training call: each poll returns the next scripted result (else nothing new)."""

    def __init__(self, futures: dict[Any, RankedWorker]) -> None:
        self.futures = futures
        self.results: deque[PollResult] = deque()
        self.acknowledged: list[int] = []
        self.settled_within: float | None = None
        self.drained: list[tuple[RankedWorker, dict[str, list[dict[str, Any]]]]] = []

    def poll(self, metrics_acknowledged: int) -> PollResult:
        self.acknowledged.append(metrics_acknowledged)
        return self.results.popleft() if self.results else PollResult()

    def settle_interrupted(self, timeout_s: float) -> None:
        self.settled_within = timeout_s

    def drain(self, metrics_acknowledged: int) -> list[tuple[RankedWorker, dict[str, list[dict[str, Any]]]]]:
        drained, self.drained = self.drained, []
        return drained


@dataclass
class Driver:
    """A controller over fakes, and the fakes, to script and to look at."""

    controller: Controller
    clock: FakeClock
    ray: FakeRay
    bundles: FakeBundles
    group: FakeGroup
    standby: FakeStandby
    reporter: FakeReporter
    polls: list[FakePoll] = field(default_factory=list)

    @property
    def poll(self) -> FakePoll:
        """The latest training call's."""
        return self.polls[-1]

    def step(self) -> State:
        self.controller.state = self.controller.step(self.controller.state)
        return self.controller.state

    def running(self) -> Running:
        """Started, the group formed on the admitted bundles and training."""
        running = self.step()
        assert isinstance(running, Running)
        return running

    def worker(self, rank: int) -> RankedWorker:
        return next(worker for worker in self.group.workers if worker.rank == rank)


def _driver(
    tmp_path: Path, *, min_: int, max_: int, admitted: int, standby: int = 0, nodes: dict[int, str] | None = None
) -> Driver:
    spec = JobSpec.model_validate(
        {
            "name": "fake",
            "model": "mlp",
            "train": {"global_batch_size": 12, "micro_batch_size": 1},
            "workers": {"min": min_, "max": max_, "standby": standby},
        }
    )
    clock, ray_facade, bundles, reporter = FakeClock(), FakeRay(), FakeBundles(admitted, nodes), FakeReporter()
    group, standbys = FakeGroup(bundles), FakeStandby()
    polls: list[FakePoll] = []

    def start_poll(_group: Any, futures: dict[Any, RankedWorker]) -> FakePoll:
        polls.append(FakePoll(futures))
        return polls[-1]

    controller = Controller(
        spec,
        "job-0123456789",
        1,
        str(tmp_path),
        reporter,  # type: ignore[arg-type]
        group=group,
        bundles=bundles,
        standby=standbys,
        ray=ray_facade,
        clock=clock,
        start_poll=start_poll,
    )
    return Driver(controller, clock, ray_facade, bundles, group, standbys, reporter, polls)


@pytest.fixture(autouse=True)
def _nothing_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(seconds: float) -> None:
        raise AssertionError(f"the controller slept {seconds}s outside its clock")

    monkeypatch.setattr(time, "sleep", refuse)


class FakeTaskError(Exception):
    """As Ray's RayTaskError: the remote traceback as its text."""

    cause = None


def _snapshot(step: int, files: list[str], required: list[list[str]] | None) -> dict[str, Any]:
    return {"generation": 1, "step": step, "files": files, "required": required}


# -- Starting ------------------------------------------------------------------------------------------------------


def test_starting_forms_the_admitted_workers_and_runs(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=3, admitted=3)
    running = driver.running()
    assert driver.group.launched == [driver.bundles.admission]
    assert driver.group.formed == [driver.group.workers] and driver.group.world_size == 3
    assert driver.group.trained == [None]  # a first group resumes from the latest committed checkpoint, if any
    assert running.poll is driver.poll and list(driver.poll.futures.values()) == driver.group.workers
    assert driver.standby.wanted == [0]  # standby capacity reserved first (none asked for)
    [report] = driver.reporter.reports
    assert report["state"] == "RUNNING"
    assert report["message"] == "training on 3 workers across 3 node(s)"
    assert report["details"]["world_size"] == 3
    assert [rank["rank"] for rank in report["details"]["ranks"]] == [0, 1, 2]


def test_starting_fails_when_fewer_than_workers_min_start(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=3, max_=3, admitted=3)
    driver.group.not_starting = {driver.bundles.admission[2]}
    assert driver.controller.run() == 1
    assert driver.controller.state == Failed("only 2 of 3 workers started")
    assert driver.group.formed == []
    assert driver.reporter.reports == [
        {"state": "FAILED", "message": "only 2 of 3 workers started", "metrics": None, "checkpoints": None}
    ]
    assert driver.group.shut_down and driver.standby.shut_down and driver.bundles.released


def test_starting_forms_the_group_at_the_size_the_scaling_policy_decides(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=3, admitted=4)
    driver.running()
    [formed] = driver.group.formed
    assert len(formed) == 3 == driver.group.world_size
    assert len(driver.ray.killed) == 1 and driver.ray.killed[0] not in [worker.actor for worker in formed]


# -- Running -------------------------------------------------------------------------------------------------------


def test_running_finishes_succeeded_on_the_final_outcome(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=2, admitted=2)
    driver.running()
    outcome = {"stopped": False, "step": 100, "checkpoint_uri": "file:///ckpt/step-100"}
    driver.poll.results.append(PollResult(finished=[outcome, outcome]))
    assert driver.step() == Finished(succeeded=True)
    assert driver.reporter.reports[-1]["state"] == "SUCCEEDED"
    assert driver.reporter.reports[-1]["message"] == "finished at step 100, checkpoint file:///ckpt/step-100"


def test_running_ends_unsucceeded_when_the_control_plane_ended_the_attempt(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=2, admitted=2)
    driver.running()
    driver.reporter.end("CANCELLED")
    assert driver.controller.run() == 0
    assert driver.controller.state == Finished(succeeded=False)
    assert driver.poll.acknowledged == []  # not polled again
    assert driver.reporter.states == ["RUNNING"]  # nothing more: the control plane no longer listens
    assert driver.group.shut_down and driver.standby.shut_down and driver.bundles.released


def test_running_forwards_rank_0s_metrics_and_events_and_each_ranks_memory(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=2, admitted=2)
    driver.running()
    memory = {"parameter_count": 10, "parameters_bytes": 40, "gradients_bytes": 40, "optimizer_bytes": 80, "dp": 2}
    rank0: dict[str, list[dict[str, Any]]] = {
        "metrics": [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}],
        "checkpoints": [],
        "events": [{"message": "validation loss 1.9 at step 2", "details": {"val_loss": 1.9}}],
        "memory": [{"rank": 0, **memory}],
    }
    rank1: dict[str, list[dict[str, Any]]] = {
        "metrics": [],
        "checkpoints": [],
        "events": [],
        "memory": [{"rank": 1, **memory}],
    }
    driver.poll.results.append(PollResult(drained=[(driver.worker(0), rank0), (driver.worker(1), rank1)]))
    assert isinstance(driver.step(), Running)
    progress, event = driver.reporter.reports[1:]
    assert [point.step for point in progress["metrics"]] == [1, 2]
    assert [measured.rank for measured in progress["memory"]] == [0, 1]
    assert event["message"] == "validation loss 1.9 at step 2" and event["details"] == {"val_loss": 1.9}
    driver.reporter.handled_seq = 2  # the control plane answered for the progress report
    driver.step()
    assert driver.poll.acknowledged == [0, 2]  # rank 0 may drop the two points it was answered for


def test_running_recovers_from_a_lost_worker(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=3, admitted=3)
    driver.running()
    lost = driver.worker(1)
    driver.poll.results.append(PollResult(lost=[lost]))
    assert driver.step() == Recovering([lost], "lost rank(s) [1] on node(s) ['node-1']")
    assert driver.poll.settled_within == COLLECTIVE_TIMEOUT_S  # the survivors' broken calls are taken meanwhile
    assert not driver.controller.state.while_forming  # type: ignore[union-attr]
    assert driver.reporter.states == ["RUNNING"]  # Recovering reports the loss (next test)


def test_running_fails_the_job_on_the_users_error_as_the_failure_policy_decides(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=2, admitted=2)
    driver.running()
    # A collective failing with every worker alive is recovered from ...
    driver.poll.results.append(PollResult(errors=[FakeTaskError("gloo: Connection reset by peer")]))  # type: ignore[list-item]
    assert isinstance(driver.step(), Recovering)
    # ... the user's exception fails the job with its traceback, what rank 0 recorded reported before it.
    driver.controller.state = driver.controller._train()
    driver.poll.results.append(PollResult(errors=[FakeTaskError("train()\nValueError: bad batch")]))  # type: ignore[list-item]
    driver.poll.drained = [(driver.worker(0), {"metrics": [{"step": 7, "loss": 1.0}], "checkpoints": [], "memory": []})]
    assert driver.controller.run() == 1
    assert isinstance(driver.controller.state, Failed)
    assert driver.controller.state.reason.startswith("training raised an exception in train()")
    assert "ValueError: bad batch" in driver.controller.state.reason
    last_progress, failed = driver.reporter.reports[-2:]
    assert [point.step for point in last_progress["metrics"]] == [7]
    assert failed["state"] == "FAILED" and "ValueError: bad batch" in failed["message"]


def test_running_asks_the_group_to_stop_once_when_warm_workers_let_it_grow(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=3, admitted=2)
    running = driver.running()
    driver.standby.warming = [_worker(driver.bundles.add("node-7"), "node-7")]
    assert driver.step() is running and running.stopping
    assert driver.group.stop_requests == 1
    assert driver.standby.wanted[-1] == 1  # the one worker the group would grow by
    assert (
        driver.reporter.reports[-1]["message"] == "worker warm on node node-7: the group grows to it at the next step"
    )
    driver.step()
    assert driver.group.stop_requests == 1  # asked once


def test_running_reports_a_standby_ready_without_growing_at_max(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=2, admitted=2, standby=1)
    running = driver.running()
    driver.standby.warming = [_worker(driver.bundles.add("node-7"), "node-7")]
    driver.step()
    assert not running.stopping and driver.group.stop_requests == 0
    assert driver.reporter.reports[-1]["message"] == "standby worker ready on node node-7"


def test_a_group_stopped_at_a_step_to_grow_is_resizing(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=3, admitted=2)
    driver.running()
    stopped = {"stopped": True, "step": 40, "checkpoint_uri": "file:///ckpt/step-40"}
    driver.poll.results.append(PollResult(finished=[stopped, stopped]))
    assert driver.step() == Resizing()
    assert driver.reporter.states == ["RUNNING"]  # no SUCCEEDED: it stopped to grow


def test_a_preempted_group_stops_at_its_next_step_saves_and_the_attempt_ends_preempted(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=2, admitted=2)
    running = driver.running()
    driver.reporter.preempt("job-high")
    assert driver.step() is running and running.preempting and driver.group.stop_requests == 1
    driver.step()
    assert driver.group.stop_requests == 1, "asked once"
    stopped = {"stopped": True, "step": 40, "checkpoint_uri": "file:///ckpt/step-40"}
    driver.poll.results.append(PollResult(finished=[stopped, stopped]))
    assert driver.step() == Finished(succeeded=False)
    preempted = driver.reporter.reports[-1]
    assert preempted["state"] == "PREEMPTED"
    assert preempted["message"] == "saved at step 40 (file:///ckpt/step-40) and stopped, preempted for job job-high"
    assert preempted["details"]["step"] == 40


def test_a_preemption_while_growing_still_ends_the_attempt_instead_of_resizing(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=3, admitted=2)
    running = driver.running()
    driver.standby.warming = [_worker(driver.bundles.add("node-7"), "node-7")]
    driver.step()
    assert running.stopping and driver.group.stop_requests == 1
    driver.reporter.preempt(None)
    driver.step()
    assert driver.group.stop_requests == 1, "the stop already asked for serves the preemption"
    stopped = {"stopped": True, "step": 41, "checkpoint_uri": "file:///ckpt/step-41"}
    driver.poll.results.append(PollResult(finished=[stopped, stopped]))
    assert driver.step() == Finished(succeeded=False)
    assert driver.reporter.reports[-1]["message"].endswith("moving off a draining node")


def test_a_preemption_while_re_forming_ends_the_attempt_at_once(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=3, admitted=2)
    driver.running()
    driver.reporter.preempt("job-high")
    assert driver.controller.step(Resizing()) == Finished(succeeded=False)
    assert driver.reporter.reports[-1]["state"] == "PREEMPTED"


# -- Recovering and Resizing -----------------------------------------------------------------------------------------


def test_recovering_keeps_the_survivors_removes_the_lost_and_takes_standbys(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=3, admitted=3, standby=1)
    driver.running()
    standby = _worker(driver.bundles.add("node-9"), "node-9")
    driver.standby.ready = [standby]
    survivors, lost = [driver.worker(0), driver.worker(2)], driver.worker(1)
    driver.controller.state = Recovering([lost], "lost rank(s) [1] on node(s) ['node-1']")
    placing = driver.step()
    assert isinstance(placing, Placing) and placing.recovering
    assert driver.group.removed == [[lost]] and driver.group.workers == survivors
    assert driver.bundles.lost_nodes == {"node-1"}  # its node is gone: its bundle waits for Ray to move it
    assert placing.standbys == [standby] and placing.wanted == 0  # at min with the standby: nothing new to start
    assert placing.world_size_before == 3 and placing.waiting_since == driver.clock.now
    recovering = driver.reporter.reports[-1]
    assert recovering["state"] == "RECOVERING"
    assert recovering["message"] == "lost rank(s) [1] on node(s) ['node-1']; re-forming the group"
    assert recovering["details"] == {
        "lost_ranks": [1],
        "lost_nodes": ["node-1"],
        "lost_pids": [lost.pid],
        "world_size_before": 3,
    }


def test_recovering_probes_the_workers_that_share_a_lost_workers_node(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=1, max_=3, admitted=3, nodes={1: "node-x", 2: "node-x"})
    driver.running()
    first_lost = next(worker for worker in driver.group.workers if worker.node_id == "node-x")
    other = next(worker for worker in driver.group.workers if worker.node_id == "node-x" and worker is not first_lost)
    driver.group.silent = [other]
    driver.controller.state = Recovering([first_lost], "lost")
    driver.step()
    assert driver.group.probed == [[other]]
    assert driver.group.removed == [[first_lost, other]]
    assert driver.reporter.reports[-1]["details"]["lost_ranks"] == sorted([first_lost.rank, other.rank])


def test_a_worker_whose_process_alone_died_leaves_its_bundle_to_a_replacement(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=2, admitted=2)
    driver.running()
    lost = driver.worker(1)
    driver.ray.process_deaths = {lost.actor_id}
    driver.controller.state = Recovering([lost], "lost")
    placing = driver.step()
    assert driver.bundles.lost_nodes == set()
    assert isinstance(placing, Placing) and placing.wanted == 1
    assert isinstance(driver.step(), Running)  # the replacement started on the lost worker's own bundle
    assert driver.group.launched[-1] == [lost.slot]


def test_recovery_below_min_waits_for_the_workers_warming_up(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=2, admitted=2, standby=1)
    driver.running()
    warming = _worker(driver.bundles.add("node-9"), "node-9")
    driver.standby.warming = [warming]
    driver.controller.state = Recovering([driver.worker(1)], "lost")
    placing = driver.step()
    assert driver.standby.waited_for_starting == 1
    assert isinstance(placing, Placing) and placing.standbys == [warming] and placing.wanted == 0


def test_recovery_waits_on_the_clock_for_ray_to_move_the_lost_bundle(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=2, admitted=2)
    driver.running()
    lost = driver.worker(1)
    driver.bundles.capacity = 1  # spare capacity: Ray moves the lost node's bundle onto it
    driver.bundles.moves = {driver.bundles.looks + 4: (lost.slot, "node-8")}  # seen at the third look in the wait
    driver.controller.state = Recovering([lost], "lost")
    placing = driver.step()
    assert driver.clock.slept == [REPLACEMENT_POLL_S] * 2
    assert isinstance(placing, Placing) and placing.waiting_since == driver.clock.now
    assert isinstance(driver.step(), Running)
    assert driver.group.launched[-1] == [lost.slot]


def test_recovery_stops_waiting_for_a_moved_bundle_at_the_replacement_wait(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=2, admitted=2)
    driver.running()
    driver.bundles.capacity = 1  # spare capacity, but Ray never moves the bundle
    driver.controller.state = Recovering([driver.worker(1)], "lost")
    began = driver.clock.now
    placing = driver.step()
    assert set(driver.clock.slept) == {REPLACEMENT_POLL_S}
    assert driver.clock.now - began == pytest.approx(REPLACEMENT_WAIT_S, abs=REPLACEMENT_POLL_S)
    assert isinstance(placing, Placing) and placing.waiting_since == driver.clock.now


def test_resizing_takes_the_warm_workers_and_forms_the_larger_group(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=3, admitted=2)
    driver.running()
    warm = _worker(driver.bundles.add("node-7"), "node-7")
    driver.standby.ready = [warm]
    driver.controller.state = Resizing()
    placing = driver.step()
    assert isinstance(placing, Placing) and not placing.recovering
    assert placing.reason == "capacity returned" and placing.world_size_before == 2
    assert placing.standbys == [warm] and driver.group.removed == []
    assert isinstance(driver.step(), Running)
    assert driver.group.world_size == 3 and warm in driver.group.workers
    grew = driver.reporter.reports[-1]
    assert grew["state"] is None  # the job stays RUNNING
    assert grew["message"] == (
        "capacity returned: re-formed at 3 workers (was 2), resuming from step 20 (durable checkpoint)"
    )
    assert grew["details"]["standby_workers_used"] == 1 and grew["details"]["workers_missing"] == 0


# -- Placing -------------------------------------------------------------------------------------------------------


def _lose(driver: Driver, *ranks: int) -> list[RankedWorker]:
    lost = [driver.worker(rank) for rank in ranks]
    nodes = sorted({worker.node_id for worker in lost})
    driver.controller.state = Recovering(lost, f"lost rank(s) {list(ranks)} on node(s) {nodes}")
    return lost


def test_placing_resumes_from_the_newest_snapshot_in_the_members_memory(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=3, admitted=3, standby=1)
    driver.running()
    driver.standby.ready = [_worker(driver.bundles.add("node-9"), "node-9")]
    _lose(driver, 1)
    driver.step()
    driver.group.inventories = [[_snapshot(30, ["shard-0"], [["shard-0"]])], [_snapshot(30, [], None)], []]
    assert isinstance(driver.step(), Running)
    assert driver.group.trained[-1] == {"generation": 1, "step": 30}
    assert driver.ray.got == []  # no checkpoint asked of rank 0
    running = driver.reporter.reports[-1]
    assert running["state"] == "RUNNING"
    assert running["message"] == "re-formed at 3 workers (was 3), resuming from step 30 (peers' memory)"
    details = running["details"]
    assert details["resumed_from"] == "memory" and details["resumed_from_step"] == 30
    assert details["world_size"] == 3 and details["world_size_before"] == 3 and details["standby_workers_used"] == 1
    assert details["regroup_s"] == 0.0  # the fake clock stood still


def test_placing_resumes_from_the_durable_checkpoint_when_no_snapshot_is_whole(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=1, max_=2, admitted=2)
    driver.running()
    _lose(driver, 1)
    driver.step()
    driver.group.inventories = [[_snapshot(30, ["shard-0"], [["shard-0"], ["shard-1"]])]]
    assert isinstance(driver.step(), Running)
    rank0 = driver.worker(0).actor
    assert rank0.resume_step.calls == [(f"{tmp_path}/job-0123456789", None)]
    assert driver.ray.got == [FakeRef(20)] and driver.group.trained[-1] is None
    fallback, running = driver.reporter.reports[-2:]
    assert fallback["message"] == (
        "the in-memory snapshot of step 30 lacks shard-1 (a shard and every copy of it are lost): "
        "resuming from the durable checkpoint of step 20"
    )
    assert running["message"] == "re-formed at 1 workers (was 2), resuming from step 20 (durable checkpoint)"
    assert running["details"]["resumed_from"] == "storage"


class _FormsAt(ScalingPolicy):
    """A scaling policy that forms smaller groups than the members at hand (as a planned shrink will)."""

    def __init__(self, workers: WorkersSpec, size: int) -> None:
        super().__init__(workers, CAPACITY_WAIT_S)
        self.size = size

    def decide(self, available: int, waited_s: float, reason: str) -> FormGroup | WaitForCapacity | GiveUp:
        return FormGroup(self.size)


def test_placing_forms_the_group_at_the_size_the_scaling_policy_decides(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=1, max_=3, admitted=3)
    driver.running()
    driver.controller.scaling = _FormsAt(driver.controller.spec.workers, 1)
    _lose(driver, 2)
    driver.step()
    survivors = list(driver.group.workers)
    assert isinstance(driver.step(), Running)
    assert driver.group.formed[-1] == survivors[:1] and driver.group.world_size == 1
    assert driver.ray.killed == [survivors[1].actor]


def test_placing_waits_for_capacity_and_ends_the_workers_it_started(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=3, max_=3, admitted=3)
    driver.running()
    _lose(driver, 1, 2)
    spare = driver.bundles.add("node-7")  # one of the two missing workers can be placed
    placing = driver.step()
    assert isinstance(placing, Placing) and placing.wanted == 2
    assert driver.step() is placing
    assert driver.group.launched[-1] == [spare]
    [added] = driver.ray.killed  # the new worker does not hold its bundle while the group waits
    assert added not in [worker.actor for worker in driver.group.workers]
    assert driver.clock.slept == [CAPACITY_LOOK_S]
    assert len(driver.group.formed) == 1  # not re-formed
    assert driver.reporter.states == ["RUNNING", "RECOVERING"]


def test_placing_gives_up_after_the_capacity_wait(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=3, max_=3, admitted=3)
    driver.running()
    _lose(driver, 1, 2)
    driver.bundles.add("node-7")
    assert driver.controller.run() == 1
    reason = "lost rank(s) [1, 2] on node(s) ['node-1', 'node-2']; only 2 of workers.min 3 can be placed"
    assert driver.controller.state == Failed(reason)
    # Looked once a (fake) second until the wait was over: no real time passed.
    assert driver.clock.slept == [CAPACITY_LOOK_S] * (int(CAPACITY_WAIT_S / CAPACITY_LOOK_S) + 1)
    assert len(driver.ray.killed) == len(driver.clock.slept) + 1  # each look's new worker ended
    assert driver.reporter.states == ["RUNNING", "RECOVERING", "FAILED"]
    assert driver.reporter.reports[-1]["message"] == reason
    assert driver.group.shut_down and driver.standby.shut_down and driver.bundles.released


def test_placing_ends_unsucceeded_when_the_control_plane_ended_the_attempt_while_it_waited(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=3, max_=3, admitted=3)
    driver.running()
    _lose(driver, 1, 2)
    driver.step()
    driver.reporter.end("CANCELLED")
    assert driver.step() == Finished(succeeded=False)
    assert driver.clock.slept == []


# -- a member lost while the group forms -----------------------------------------------------------------------------


def test_a_member_dying_while_the_first_group_forms_recovers_from_world_size_zero(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=3, admitted=3)
    driver.group.lost_while_forming = {"node-2"}
    recovering = driver.step()
    [dying] = driver.group.silent
    assert recovering == Recovering(
        [dying], "lost rank(s) [2] of the group being formed on node(s) ['node-2']", world_size_before_forming=0
    )
    assert driver.reporter.reports == []  # not RUNNING: the group never formed
    placing = driver.step()
    assert isinstance(placing, Placing) and placing.recovering and placing.world_size_before == 0
    lost = driver.reporter.reports[-1]
    assert lost["state"] is None  # the job is still ADMITTED: no new loss to count
    assert lost["details"]["world_size_before"] == 0
    assert isinstance(driver.step(), Running)
    assert driver.reporter.states == ["RUNNING"]
    assert driver.reporter.reports[-1]["message"].startswith("re-formed at 2 workers (was 0)")


def test_a_member_dying_while_the_group_re_forms_keeps_the_world_size_before(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=1, max_=3, admitted=3)
    driver.running()
    _lose(driver, 2)
    driver.step()
    dying = driver.worker(1)
    driver.group.lost_while_forming = {dying.node_id}
    recovering = driver.step()
    assert isinstance(recovering, Recovering) and recovering.lost == [dying]
    assert recovering.while_forming and recovering.world_size_before_forming == 3
    placing = driver.step()
    assert isinstance(placing, Placing) and placing.world_size_before == 3
    assert driver.reporter.states == ["RUNNING", "RECOVERING"]  # the second loss is not a new recovery
    assert isinstance(driver.step(), Running)
    assert driver.reporter.reports[-1]["state"] == "RUNNING"
    assert driver.reporter.reports[-1]["message"].startswith("re-formed at 1 workers (was 3)")


def test_a_formation_that_fails_with_every_member_answering_is_a_driver_error(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=2, max_=2, admitted=2)
    driver.group.lost_while_forming = {"node-9"}  # the join raises, yet every member answers the probe
    assert driver.controller.run() == 1
    assert isinstance(driver.controller.state, Failed)
    assert driver.controller.state.reason.startswith("driver error:\n")
    assert "RayActorError" in driver.controller.state.reason
    assert driver.reporter.states == ["FAILED"]


def test_every_state_has_its_transition(tmp_path: Path) -> None:
    driver = _driver(tmp_path, min_=1, max_=1, admitted=1)
    with pytest.raises(AssertionError, match="no transition"):
        driver.controller.step(Finished(succeeded=True))
    assert isinstance(driver.controller.step(Starting()), Running)
