"""The control plane's Ray connection, in a process of its own that can die and be replaced.

Ray allows one cluster connection per process, and its core client aborts the whole process when the cluster it
joined is replaced by a new one at the same address (`WrongClusterID` after a head restart). So the API and
dispatcher process never joins the cluster itself: what needs a Ray driver (placement groups, the warm pool's
detached workers) runs in a child process, the agent, spoken to over its stdin and stdout a JSON line at a time.
The Jobs API is Ray's REST API and is called from the control plane directly.

When the agent exits (Ray aborted it), stops answering, or cannot join, the call in flight fails with
`AgentUnavailable` and the next call starts a new agent, which joins whatever cluster now answers at the address.
The agent exits by itself when its stdin closes: it never outlives the control plane.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import IO, Any, NoReturn, Protocol, cast

from ringmaster.service import driver_handoff
from ringmaster.service.naming import NAMESPACE

log = logging.getLogger(__name__)

CONTROL_PLANE_JOB_NAME = "ringmaster control plane (its warm pool workers)"
JOIN_TIMEOUT_S = 90.0  # a new agent's `import ray` and ray.init, on a loaded machine
CALL_TIMEOUT_S = 30.0  # any call, beyond the wait it asks for (a reservation's wait_s)
_STDERR_LINES = 20
# What Ray says when the GCS it joined was replaced by a new cluster at the same address. Without token authentication
# its core client aborts the agent's process; with it, each call raises this instead, and the agent would live on
# joined to a cluster that is gone.
_CLUSTER_REPLACED = "WrongClusterID"


class ClusterUnreachable(RuntimeError):
    """The Ray cluster does not answer now (down, or restarting): expected for a while, and retried."""


class AgentUnavailable(ClusterUnreachable):
    """The Ray agent exited, did not answer in time, or could not join the cluster; the next call starts another."""


class AgentRefused(RuntimeError):
    """Ray, inside a live agent, raised an error for this call; the agent goes on serving."""


class WarmPool(Protocol):
    """The cluster's pool of idle warm workers (workers/warm_pool.py), topped up by the dispatcher."""

    per_node: int

    # Returns what it started and killed (for tests); the agent does not read it.
    def tick(self, active_claimants: set[str], runtime_envs: dict[str, dict[str, Any]]) -> object: ...


# per_node -> a pool keeper; the composition root supplies it (it lives with the workers).
WarmPoolFactory = Callable[[int], WarmPool]


# -- the control plane's side ------------------------------------------------------------------------------------


class RayAgent:
    """A handle on the agent process: starts it on first use, and again after it is lost. Thread-safe (one call
    at a time)."""

    def __init__(
        self, command: list[str], join_timeout_s: float = JOIN_TIMEOUT_S, env: dict[str, str] | None = None
    ) -> None:
        """`env`: the agent's whole environment (this process's by default); RayCluster's carries the cluster's
        token: the control plane's own process never holds it in its environment."""
        self.command = command
        self.join_timeout_s = join_timeout_s
        self.env = env
        self.starts = 0  # agents started so far: more than one means the cluster connection was replaced
        self._process: subprocess.Popen[str] | None = None
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: deque[str] = deque(maxlen=_STDERR_LINES)
        self._stderr_pump: threading.Thread | None = None
        self._next_id = 0
        self._lock = threading.Lock()

    def call(self, op: str, timeout_s: float = CALL_TIMEOUT_S, **args: Any) -> Any:
        with self._lock:
            process = self._ensure_started()
            self._next_id += 1
            request = {"id": self._next_id, "op": op, "args": args}
            try:
                _stdin(process).write(json.dumps(request) + "\n")
                _stdin(process).flush()
            except (BrokenPipeError, OSError, ValueError) as error:
                self._lose(f"its stdin is closed ({error})")
            reply = self._reply(process, timeout_s, f"answer {op}")
            if reply.get("id") != request["id"]:
                self._lose(f"it answered request {reply.get('id')} to request {request['id']}")
            if "error" in reply:
                if _CLUSTER_REPLACED in reply["error"]:
                    self._lose(f"its cluster was replaced by another at the same address: {reply['error']}")
                raise AgentRefused(reply["error"])
            return reply.get("result")

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the agent now (else on the first call); AgentUnavailable if it cannot join the cluster."""
        with self._lock:
            self._ensure_started()

    def close(self) -> None:
        with self._lock:
            self._end(graceful=True)

    def _ensure_started(self) -> subprocess.Popen[str]:
        """The agent's process: the running one, else a new one that has joined the cluster."""
        if self._process is not None and self._process.poll() is None:  # self.running, spelled out for mypy
            return self._process
        self._end(graceful=False)
        self._replies = queue.Queue()
        self._stderr.clear()
        self._process = process = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=self.env,
        )
        self.starts += 1
        threading.Thread(
            target=_pump, args=(process.stdout, self._replies.put, True), daemon=True, name="ray-agent-replies"
        ).start()
        self._stderr_pump = threading.Thread(
            target=_pump, args=(process.stderr, self._log_stderr), daemon=True, name="ray-agent-stderr"
        )
        self._stderr_pump.start()
        ready = self._reply(process, self.join_timeout_s, "join the cluster")
        if "error" in ready:
            self._lose(ready["error"])
        log.info("Ray agent %d (pid %d) joined the cluster", self.starts, process.pid)
        return process

    def _reply(self, process: subprocess.Popen[str], timeout_s: float, doing: str) -> dict[str, Any]:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            self._lose(f"it did not {doing} within {timeout_s:.0f} s")
        if reply is None:
            code = process.wait(timeout=10)
            if self._stderr_pump is not None:  # started with the process
                self._stderr_pump.join(timeout=2)  # its last words, for the message
            self._lose(f"it exited with code {code}")
        return reply

    def _lose(self, why: str) -> NoReturn:
        """End this agent and raise: the next call starts another."""
        tail = " | ".join(self._stderr)
        self._end(graceful=False)
        raise AgentUnavailable(f"the Ray agent is lost: {why}" + (f"; its last words: {tail}" if tail else ""))

    def _end(self, graceful: bool) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            try:
                _stdin(process).close()  # the agent's cue to leave the cluster and exit
            except OSError:
                pass
            try:
                process.wait(timeout=10 if graceful else 0.5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)

    def _log_stderr(self, line: str | None) -> None:
        if line:
            self._stderr.append(line.rstrip())
            log.warning("Ray agent: %s", line.rstrip())


def _stdin(process: subprocess.Popen[str]) -> IO[str]:
    """The agent's stdin, never None: it is started with stdin=PIPE."""
    return cast(IO[str], process.stdin)


def _pump(stream: IO[str], put: Callable[[Any], None], parse: bool = False) -> None:
    """Every line of stream (parsed as JSON when `parse`), then None at its end."""
    for line in stream:
        if parse:
            try:
                line = json.loads(line)
            except ValueError:
                log.warning("Ray agent wrote a line that is no reply: %s", line.rstrip())
                continue
        put(line)
    put(None)


# -- the agent's side --------------------------------------------------------------------------------------------


class AgentOps:
    """What the agent does for the control plane, as a Ray driver of its own cluster connection."""

    def __init__(self, address: str, warm_pool_factory: WarmPoolFactory | None = None) -> None:
        import ray
        import ray.job_config

        self._ray = ray
        # Named, as the dashboard's job list shows it: this connection owns the warm pool's workers.
        ray.init(
            address=address,
            namespace=NAMESPACE,
            logging_level=logging.WARNING,
            log_to_driver=False,
            configure_logging=False,
            job_config=ray.job_config.JobConfig(metadata={"job_name": CONTROL_PLANE_JOB_NAME}),
        )
        self._warm_pool_factory = warm_pool_factory
        self._warm_pool: WarmPool | None = None

    def reserve(self, name: str, bundles: list[dict[str, float]], wait_s: float) -> bool:
        """All-or-nothing: a placement group of these bundles is ready within wait_s, or nothing is held."""
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group(bundles, strategy="PACK", name=name, lifetime="detached")
        ready, _ = self._ray.wait([group.ready()], timeout=wait_s)
        if ready:
            return True
        remove_placement_group(group)
        return False

    def release(self, name: str) -> None:
        from ray.util import get_placement_group
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(get_placement_group(name))
        except ValueError:
            pass  # already removed

    def keep_warm(self, per_node: int, active_submissions: list[str], runtime_envs: dict[str, dict[str, Any]]) -> None:
        if self._warm_pool_factory is None:
            return
        if self._warm_pool is None or self._warm_pool.per_node != per_node:
            self._warm_pool = self._warm_pool_factory(per_node)
        self._warm_pool.tick(set(active_submissions), runtime_envs)

    def node_capacities(self) -> list[dict[str, float]]:
        """Each live node's total CPUs and GPUs, whatever runs there now."""
        return [
            {"CPU": node["Resources"].get("CPU", 0.0), "GPU": node["Resources"].get("GPU", 0.0)}
            for node in self._ray.nodes()  # type: ignore[no-untyped-call]  # Ray leaves nodes() unannotated
            if node["Alive"]
        ]

    def cluster_view(self, groups: list[str]) -> dict[str, Any]:
        """One read of the cluster for a scheduling pass: each live node's total and unreserved CPUs and GPUs, and
        the node of each bundle of the named placement groups that exist (None: a bundle not placed now)."""
        from ray.util.placement_group import placement_group_table

        from ringmaster.service.ray_internals import free_resources_by_node

        free = free_resources_by_node()
        nodes = [
            {
                "id": node["NodeID"],
                "CPU": node["Resources"].get("CPU", 0.0),
                "GPU": node["Resources"].get("GPU", 0.0),
                "free_CPU": free.get(node["NodeID"], {}).get("CPU", 0.0),
                "free_GPU": free.get(node["NodeID"], {}).get("GPU", 0.0),
            }
            for node in self._ray.nodes()  # type: ignore[no-untyped-call]  # Ray leaves nodes() unannotated
            if node["Alive"]
        ]
        wanted = set(groups)
        placements: dict[str, list[str | None]] = {}
        for table in placement_group_table().values():
            if table.get("name") in wanted and table.get("state") != "REMOVED":
                on_nodes = table.get("bundles_to_node_id", {})
                placements[table["name"]] = [on_nodes.get(index) for index in range(len(table.get("bundles", {})))]
        return {"nodes": nodes, "groups": placements}

    def draining_nodes(self) -> dict[str, float | None]:
        from ringmaster.service.ray_internals import draining_nodes

        return draining_nodes()

    def drain_node(self, node_id: str, deadline: float | None, reason: str) -> dict[str, Any]:
        """Ask Ray to drain a live node (nothing new is placed there; the dispatcher moves its jobs off): {"refused":
        why} when there is no such live node or Ray refuses, else {"refused": None}."""
        from ringmaster.service.ray_internals import drain_node

        alive = {node["NodeID"] for node in self._ray.nodes() if node["Alive"]}  # type: ignore[no-untyped-call]
        if node_id not in alive:
            return {"refused": f"no live Ray node has id {node_id!r}", "unknown": True}
        return {"refused": drain_node(node_id, deadline, reason), "unknown": False}

    def request_resources(self, bundles: list[dict[str, float]]) -> None:
        """Tell Ray's autoscaler the shapes the cluster should hold at once (replacing the previous request; [] clears
        it). A hint the autoscaler bin-packs onto nodes it may add; a cluster without one ignores it."""
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=bundles)

    def ping(self) -> str:
        address: str = self._ray.get_runtime_context().gcs_address  # Ray's property is unannotated
        return address

    def put_driver_handoff(self, submission_id: str, handoff: str) -> None:
        """Leave an attempt's report secret and spec (DriverHandoff.to_json) in the GCS for its driver to take."""
        from ringmaster.service.ray_internals import RayInternalKv  # imports Ray: the agent's process has it

        driver_handoff.put(RayInternalKv(), submission_id, handoff)

    def drop_driver_handoff(self, submission_id: str) -> None:
        """Remove an attempt's handoff that no driver took."""
        from ringmaster.service.ray_internals import RayInternalKv

        driver_handoff.drop(RayInternalKv(), submission_id)

    def shutdown(self) -> None:
        self._ray.shutdown()


def serve(address: str, warm_pool_factory: WarmPoolFactory | None = None) -> None:
    """The agent's loop: join the cluster, then answer each request line on stdin until it closes. Replies go to the
    original stdout alone: anything else written there (by Ray, say) is sent to stderr instead."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    requests = sys.stdin

    def answer(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    try:
        ops = AgentOps(address, warm_pool_factory)
    except Exception as error:
        answer({"error": f"could not join the Ray cluster at {address}: {type(error).__name__}: {error}"})
        return
    answer({"ready": True})
    try:
        for line in requests:
            request = json.loads(line)
            operation = getattr(ops, request["op"], None) if not request["op"].startswith("_") else None
            try:
                if operation is None:
                    raise ValueError(f"the agent has no operation {request['op']!r}")
                answer({"id": request["id"], "result": operation(**request["args"])})
            except Exception as error:
                answer({"id": request["id"], "error": f"{type(error).__name__}: {error}"})
    finally:
        ops.shutdown()


def agent_command(module: str, address: str) -> list[str]:
    """The command that starts an agent whose entry point is `module` (this one keeps no warm pool)."""
    return [sys.executable, "-m", module, address]


def main(warm_pool_factory: WarmPoolFactory | None = None) -> None:
    parser = argparse.ArgumentParser(description="ringmaster's Ray agent (started by the control plane)")
    parser.add_argument("address", help="the Ray cluster's GCS address")
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    serve(arguments.address, warm_pool_factory)


if __name__ == "__main__":
    main()
