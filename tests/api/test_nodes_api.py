"""POST /v1/nodes/{id}/drain: an admin's drain reaches the cluster with its deadline and reason; a tenant may not,
a node Ray does not know is a 404, one Ray will not drain a 409, and a server without a cluster a 503."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ringmaster.api.app import create_app
from ringmaster.service.errors import DrainRefused, NodeNotFound
from ringmaster.service.settings import Settings
from tests.support.api_tokens import authorize, mint

NODE = "ab" * 28
HEAD = "cd" * 28


class Drains:
    """The cluster's side: records each drain; the head node is refused, as Ray may refuse one."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, float | None, str]] = []

    def __call__(self, node_id: str, deadline: float | None, reason: str) -> None:
        if node_id == HEAD:
            raise DrainRefused(f"Ray refused to drain node {node_id}: the head node cannot be drained")
        if node_id != NODE:
            raise NodeNotFound(f"no live Ray node has id {node_id!r}")
        self.asked.append((node_id, deadline, reason))


@pytest.fixture
def drains() -> Drains:
    return Drains()


@pytest.fixture
def client(db_url: str, tmp_path: Path, drains: Drains) -> Iterator[TestClient]:
    with TestClient(create_app(Settings(database_url=db_url, data_dir=tmp_path), node_drainer=drains)) as test:
        authorize(test)
        yield test


def test_an_admins_drain_reaches_the_cluster_with_its_deadline_and_reason(client: TestClient, drains: Drains) -> None:
    before = time.time()
    answer = client.post(f"/v1/nodes/{NODE}/drain", json={"deadline_s": 90, "reason": "spot notice"})
    assert answer.status_code == 202, answer.text
    [(node, deadline, reason)] = drains.asked
    assert (node, reason) == (NODE, "spot notice")
    assert deadline is not None and before + 90 <= deadline <= time.time() + 90
    body = answer.json()
    assert body["node_id"] == NODE and abs(datetime.fromisoformat(body["deadline"]).timestamp() - deadline) < 1e-3
    answer = client.post(f"/v1/nodes/{NODE}/drain", json={})
    assert answer.status_code == 202 and answer.json()["deadline"] is None
    assert drains.asked[1] == (NODE, None, "drained through ringmaster's API")


def test_a_tenant_may_not_drain_and_bad_input_is_named(client: TestClient, drains: Drains) -> None:
    tenant = {"Authorization": f"Bearer {mint(client.app, 'team-a')}"}  # type: ignore[arg-type]
    assert client.post(f"/v1/nodes/{NODE}/drain", json={}, headers=tenant).status_code == 403
    answer = client.post("/v1/nodes/not-a-node/drain", json={})
    assert answer.status_code == 422 and answer.json()["detail"][0]["field"] == "node_id"
    answer = client.post(f"/v1/nodes/{NODE}/drain", json={"deadline_s": -1})
    assert answer.status_code == 422 and answer.json()["detail"][0]["field"] == "deadline_s"
    answer = client.post(f"/v1/nodes/{'ef' * 28}/drain", json={})
    assert (answer.status_code, answer.json()["detail"]) == (404, f"no live Ray node has id '{'ef' * 28}'")
    answer = client.post(f"/v1/nodes/{HEAD}/drain", json={})
    assert answer.status_code == 409 and "head node cannot be drained" in answer.json()["detail"]
    assert drains.asked == []


def test_a_server_without_a_cluster_says_it_cannot_drain(db_url: str, tmp_path: Path) -> None:
    with TestClient(create_app(Settings(database_url=db_url, data_dir=tmp_path))) as test:
        authorize(test)
        answer = test.post(f"/v1/nodes/{NODE}/drain", json={})
    assert answer.status_code == 503 and "drives no Ray cluster" in answer.json()["detail"]
