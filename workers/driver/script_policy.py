"""What a script job's run means now, from what the driver saw of its processes: go on, succeeded (every rank exited
0), restart the whole group (workers lost: torchrun's elastic semantics), or fail the job once (a rank exited
non-zero, or its command could not start: the script's own failure, which every restart would meet again). Pure:
tests/workers/driver/test_script_policy.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ringmaster.workers.driver.policies import LostWorker


@dataclass(frozen=True)
class KeepRunning:
    pass


@dataclass(frozen=True)
class AllSucceeded:
    pass


@dataclass(frozen=True)
class RestartGroup:
    reason: str


@dataclass(frozen=True)
class FailScript:
    reason: str


ScriptDecision = KeepRunning | AllSucceeded | RestartGroup | FailScript


@dataclass(frozen=True)
class RankExit:
    """How one rank's process ended (ScriptProcess's Exit, as its worker answered), and where it ran."""

    rank: int
    node_id: str
    pid: int
    code: int
    at: float
    stopped: bool
    description: str
    start_error: str | None
    stderr_tail: Sequence[str]

    @classmethod
    def of(cls, rank: int, node_id: str, pid: int, ended: Mapping[str, Any], stderr_tail: Sequence[str]) -> RankExit:
        return cls(
            rank,
            node_id,
            pid,
            ended["code"],
            ended["at"],
            ended["stopped"],
            ended["description"],
            ended["start_error"],
            stderr_tail,
        )

    def failure_message(self) -> str:
        """The rank, its exit code and the last lines of its stderr: all a person needs, nothing of ringmaster's."""
        where = f"node {self.node_id[:12]}" + (f", pid {self.pid}" if self.pid else "")
        message = f"rank {self.rank} {self.description} ({where})"
        if self.stderr_tail:
            message += "; the last lines of its stderr:\n" + "\n".join(self.stderr_tail)
        return message


class ScriptOutcomePolicy:
    def decide(self, world_size: int, lost: Sequence[LostWorker], exits: Mapping[int, RankExit]) -> ScriptDecision:
        """`exits`: the ranks whose process has ended, by rank; `lost`: workers gone (their node, or their actor)."""
        if lost:
            nodes = sorted({worker.node_id[:12] for worker in lost})
            return RestartGroup(f"lost rank(s) {sorted(worker.rank for worker in lost)} on node(s) {nodes}")
        failed = [ended for ended in exits.values() if ended.code != 0 and not ended.stopped]
        if failed:
            return FailScript(min(failed, key=lambda ended: ended.at).failure_message())  # the first: the cause
        if len(exits) == world_size and all(ended.code == 0 for ended in exits.values()):
            return AllSucceeded()
        return KeepRunning()
