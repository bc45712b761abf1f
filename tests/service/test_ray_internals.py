"""Each private Ray API behind service/ray_internals.py is where ringmaster calls it, as it calls it: a Ray release that
moves or renames one fails here, by name (tests/cluster/test_ray_secrets.py checks their meaning on a live cluster)."""

from __future__ import annotations

import inspect
import tomllib
from pathlib import Path

import ray
from packaging.specifiers import SpecifierSet
from ray._private import state as ray_state
from ray.experimental import internal_kv

from ringmaster.service import ray_internals

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_ray_is_the_one_tested() -> None:
    requirements = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [ray_requirement] = [r for r in requirements if r.startswith("ray[")]
    assert SpecifierSet(ray_requirement.split("]", 1)[1].split(";")[0]) == SpecifierSet(ray_internals.TESTED_RAY)
    assert ray.__version__ in SpecifierSet(ray_internals.TESTED_RAY)


def _parameters(function: object) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_rays_internal_kv_takes_the_arguments_ringmaster_passes() -> None:
    keyword = inspect.Parameter.KEYWORD_ONLY
    put = _parameters(internal_kv._internal_kv_put)
    assert list(put)[:3] == ["key", "value", "overwrite"] and put["namespace"].kind == keyword, put
    get = _parameters(internal_kv._internal_kv_get)
    assert list(get)[:1] == ["key"] and get["namespace"].kind == keyword, get
    delete = _parameters(internal_kv._internal_kv_del)
    assert list(delete)[:1] == ["key"] and delete["namespace"].kind == keyword, delete
    assert delete["del_by_prefix"].default is False, "one key is deleted, not every key it starts"


def test_rays_per_node_free_resources_take_no_arguments() -> None:
    assert _parameters(ray_state.available_resources_per_node) == {}


def test_rays_drain_api_is_where_ringmaster_calls_it() -> None:
    from ray._raylet import GcsClient, InnerGcsClient
    from ray.core.generated import autoscaler_pb2

    assert list(_parameters(ray_state.GlobalState.get_draining_nodes)) == ["self"]
    assert isinstance(ray_state.state, ray_state.GlobalState)
    # The connection's GcsClient hands what it lacks to its InnerGcsClient (tests/cluster/test_elastic.py drains a node
    # through it on a live cluster).
    assert callable(GcsClient.__getattr__) and callable(InnerGcsClient.drain_node)
    assert autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION") > 0
