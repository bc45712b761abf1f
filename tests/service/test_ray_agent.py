"""The control plane's Ray agent handle (service/ray_agent.py): a lost, silent or refused agent is replaced on the
next call, and the control plane never waits on a cluster that is not there. A stand-in agent speaks the protocol
here; every test through the API server uses the real one."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from harness.ports import free_port
from ringmaster.service import ray_cluster
from ringmaster.service.ray_agent import AgentRefused, AgentUnavailable, RayAgent
from ringmaster.service.ray_cluster import RayCluster

STAND_IN = textwrap.dedent("""
    import json, os, sys, time
    if os.environ.get("JOIN_ERROR"):
        print(json.dumps({"error": os.environ["JOIN_ERROR"]}), flush=True)
        sys.exit(0)
    print("a library's chatter on stdout", flush=True)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "die":
            print("Check failed: WrongClusterID", file=sys.stderr, flush=True)
            os._exit(3)
        if request["op"] == "hang":
            time.sleep(60)
        if request["op"] == "refuse":
            print(json.dumps({"id": request["id"], "error": "ValueError: no such group"}), flush=True)
            continue
        print(json.dumps({"id": request["id"], "result": {"pid": os.getpid(), **request["args"]}}), flush=True)
""")


@pytest.fixture
def agent():
    handle = RayAgent([sys.executable, "-c", STAND_IN], join_timeout_s=30)
    yield handle
    handle.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def test_calls_reach_one_agent_until_it_dies_then_a_new_one(agent):
    first = agent.call("echo", value=1)
    assert first["value"] == 1 and agent.call("echo", value=2)["pid"] == first["pid"] and agent.starts == 1

    with pytest.raises(AgentUnavailable, match=r"exited with code 3.*WrongClusterID"):
        agent.call("die")
    replaced = agent.call("echo", value=3)
    assert replaced["value"] == 3 and replaced["pid"] != first["pid"] and agent.starts == 2


def test_a_silent_agent_is_killed_and_replaced(agent):
    stuck = agent.call("echo")["pid"]
    with pytest.raises(AgentUnavailable, match="did not answer hang within 1 s"):
        agent.call("hang", timeout_s=1)
    assert not _alive(stuck), "the silent agent was left running"
    assert agent.call("echo")["pid"] != stuck


def test_a_refused_call_keeps_the_agent(agent):
    pid = agent.call("echo")["pid"]
    with pytest.raises(AgentRefused, match="no such group"):
        agent.call("refuse")
    assert agent.call("echo")["pid"] == pid and agent.starts == 1


def test_an_agent_that_cannot_join_says_why_and_the_next_call_tries_again(monkeypatch):
    monkeypatch.setenv("JOIN_ERROR", "could not join the Ray cluster at 127.0.0.1:1: ConnectionError")
    handle = RayAgent([sys.executable, "-c", STAND_IN], join_timeout_s=30)
    with pytest.raises(AgentUnavailable, match=r"could not join the Ray cluster at 127.0.0.1:1"):
        handle.call("echo")
    monkeypatch.delenv("JOIN_ERROR")
    assert handle.call("echo", value=5)["value"] == 5 and handle.starts == 2
    handle.close()


def test_closing_ends_the_agent(agent):
    pid = agent.call("echo")["pid"]
    agent.close()
    assert not _alive(pid) and not agent.running


def test_no_agent_is_started_while_nothing_answers_at_the_clusters_address():
    address = f"127.0.0.1:{free_port()}"
    cluster = RayCluster(address, "http://127.0.0.1:1", agent=[sys.executable, "-c", STAND_IN])
    with pytest.raises(AgentUnavailable, match=f"nothing answers at the Ray cluster's address {address}"):
        cluster.reserve("group", [{"CPU": 1}], wait_s=1)
    cluster.connect()  # logs, never raises: the server comes up while its cluster is down
    assert cluster.agent.starts == 0


class _CountingJobsClient:
    """Stands in for Ray's JobSubmissionClient: each upload check turns the code zip into a package URI."""

    def __init__(self) -> None:
        self.upload_checks: list[str] = []

    def _upload_working_dir_if_needed(self, runtime_env: dict) -> None:
        self.upload_checks.append(runtime_env["working_dir"])
        runtime_env["working_dir"] = f"gcs://_ray_pkg_{len(self.upload_checks)}.zip"


def test_a_warm_pools_code_package_is_looked_up_once_per_recheck_interval_not_at_every_tick(monkeypatch):
    cluster = RayCluster(f"127.0.0.1:{free_port()}", "http://127.0.0.1:1", agent=[sys.executable, "-c", STAND_IN])
    jobs, sent, now = _CountingJobsClient(), [], [1000.0]
    cluster._jobs = jobs
    monkeypatch.setattr(cluster, "_agent_call", lambda op, **args: sent.append(args["runtime_envs"]))
    monkeypatch.setattr(ray_cluster.time, "monotonic", lambda: now[0])
    envs = {"project": {"working_dir": "/code/project.zip"}}

    for _ in range(3):
        cluster.keep_warm(2, set(), envs)
    assert jobs.upload_checks == ["/code/project.zip"]
    assert sent == [{"project": {"working_dir": "gcs://_ray_pkg_1.zip"}}] * 3
    assert envs == {"project": {"working_dir": "/code/project.zip"}}, "the caller's envs are left as they were"

    now[0] += ray_cluster.POOL_PACKAGE_RECHECK_S + 1
    cluster.keep_warm(2, set(), envs)
    assert len(jobs.upload_checks) == 2 and sent[-1] == {"project": {"working_dir": "gcs://_ray_pkg_2.zip"}}

    cluster.keep_warm(2, set(), {"project": {"working_dir": "/code/project.zip", "env_vars": {"A": "1"}}})
    assert len(jobs.upload_checks) == 3, "a pool whose env changed is looked up again"

    cluster.disconnect()  # a new cluster may lack the package
    cluster._jobs = jobs
    cluster.keep_warm(2, set(), {"project": {"working_dir": "/code/project.zip", "env_vars": {"A": "1"}}})
    assert len(jobs.upload_checks) == 4
