"""A user's code tree may hold its own top-level ``api``, ``service`` and ``workers`` packages: ringmaster's own
install as ``ringmaster.api``, ``ringmaster.service`` and ``ringmaster.workers``, so on a job's PYTHONPATH the user's
``service.spec`` and ``workers.data`` are the user's modules, not ringmaster's (nor a mix of both)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.local_control_plane import REPO_ROOT, running_control_plane, wait_for_state
from ringmaster.api.server import BackgroundServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 6

# The user's tree: packages named like ringmaster's folders, and a model that trains on values taken from them.
USER_TREE = {
    "api/__init__.py": '''
        """The user's own `api` package."""
        OWNER = "user-api"
    ''',
    "service/__init__.py": '''
        """The user's own `service` package."""
    ''',
    "service/spec.py": '''
        """The user's own `service.spec`: the shape of their data (ringmaster's service.spec has no SAMPLES)."""
        SAMPLES = 48
        FEATURES = 3
    ''',
    "workers/__init__.py": '''
        """The user's own `workers` package."""
    ''',
    "workers/data.py": '''
        """The user's own `workers.data` (ringmaster's workers.data is a package without user_dataset)."""
        import torch
        from torch.utils.data import TensorDataset


        def user_dataset(samples: int, features: int, seed: int) -> TensorDataset:
            generator = torch.Generator().manual_seed(seed)
            inputs = torch.randn(samples, features, generator=generator)
            targets = inputs @ torch.arange(1.0, features + 1).unsqueeze(1) + 0.5
            return TensorDataset(inputs, targets)
    ''',
    "usermodel.py": '''
        """A linear regression whose data comes from the user's own api, service.spec and workers.data."""
        import json
        import os
        import sys
        from pathlib import Path

        import torch.distributed as dist
        import torch.nn.functional as F
        from torch import nn

        import api
        import ringmaster.service.spec
        import ringmaster.workers
        import service
        import service.spec
        import workers
        import workers.data

        TREE = Path(__file__).resolve().parent


        def _mse(model, batch):
            inputs, targets = batch
            return F.mse_loss(model(inputs), targets)


        def build(marker_dir: str):
            mine = {"api": api, "service": service, "service.spec": service.spec, "workers": workers,
                    "workers.data": workers.data}
            files = {name: str(Path(module.__file__).resolve()) for name, module in mine.items()}
            files["ringmaster.service.spec"] = str(Path(ringmaster.service.spec.__file__).resolve())
            files["ringmaster.workers"] = str(Path(ringmaster.workers.__file__).resolve())
            strays = {name: files[name] for name in mine if not Path(files[name]).is_relative_to(TREE)}
            if strays or service.spec is ringmaster.service.spec:
                raise RuntimeError(f"not the user's modules (user tree {TREE}): {strays}; "
                                   f"cwd {os.getcwd()}, sys.path starts {sys.path[:4]}")
            rank = dist.get_rank() if dist.is_initialized() else -1
            marker = {"rank": rank, "pid": os.getpid(), "files": files, "owner": api.OWNER,
                      "samples": service.spec.SAMPLES, "features": service.spec.FEATURES}
            Path(marker_dir, f"rank-{rank}.json").write_text(json.dumps(marker))
            train = workers.data.user_dataset(service.spec.SAMPLES, service.spec.FEATURES, seed=0)
            validation = workers.data.user_dataset(service.spec.SAMPLES // 4, service.spec.FEATURES, seed=1)
            return nn.Linear(service.spec.FEATURES, 1), train, _mse, validation
    ''',
}


def _write_tree(root: Path) -> Path:
    for relative, source in USER_TREE.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip())
    return root


@pytest.fixture
def user_tree(tmp_path: Path) -> Path:
    tree = _write_tree(tmp_path / "user-code")
    assert not tree.resolve().is_relative_to(REPO_ROOT), "the user's tree must lie outside the repository"
    return tree


# A job's workers come from the warm pool (started by the control plane's own Ray connection) or, with the pool off,
# are started by the job's driver (a Ray job): both must see the user's modules.
@pytest.fixture(params=[2, 0], ids=["warm-pool", "no-warm-pool"])
def server(
    request: pytest.FixtureRequest, tmp_path: Path, user_tree: Path, shared_ray_head, monkeypatch: pytest.MonkeyPatch
) -> Iterator[BackgroundServer]:
    # The control plane starts in ringmaster's checkout, whose api/, service/ and workers/ folders are ringmaster's
    # own sources (as when pytest runs from the repository root, or in deploy/Dockerfile's WORKDIR): whatever
    # directory it starts in must not shadow the user's tree either.
    monkeypatch.chdir(REPO_ROOT)
    yield from running_control_plane(
        tmp_path / "ringmaster", head=shared_ray_head, code_path=str(user_tree), warm_workers_per_node=request.param
    )


def test_user_packages_named_api_service_workers_train_over_rest(
    server: BackgroundServer, user_tree: Path, tmp_path: Path
):
    assert server.plane.settings.code_path == str(user_tree)
    markers = tmp_path / "markers"
    markers.mkdir()
    client = server.client()
    job = client.submit(
        {
            "name": "user-code-names",
            "model": "usermodel:build",
            "data": "user",
            "strategy": "ddp",
            "model_options": {"marker_dir": str(markers)},
            "workers": {"min": 2, "max": 2, "gpus_per_worker": 0, "cpus_per_worker": 1},
            "train": {"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 4, "lr": 0.05, "seed": 0},
            "max_failures": 0,  # a user error fails the job at once, with its traceback
        }
    )
    done = wait_for_state(client, job["id"], {"SUCCEEDED", "FAILED", "CANCELLED"})
    assert done["state"] == "SUCCEEDED", done["error"]

    written = sorted(path.name for path in markers.iterdir())
    assert written == ["rank-0.json", "rank-1.json"], "every rank builds the model from the user's tree"
    tree, repo = user_tree.resolve(), REPO_ROOT.resolve()
    for name in written:
        marker = json.loads((markers / name).read_text())
        files = marker["files"]
        assert files["api"] == str(tree / "api" / "__init__.py")
        assert files["service"] == str(tree / "service" / "__init__.py")
        assert files["service.spec"] == str(tree / "service" / "spec.py")
        assert files["workers"] == str(tree / "workers" / "__init__.py")
        assert files["workers.data"] == str(tree / "workers" / "data.py")
        assert files["ringmaster.service.spec"] == str(repo / "service" / "spec.py")
        assert files["ringmaster.workers"] == str(repo / "workers" / "__init__.py")
        assert (marker["owner"], marker["samples"], marker["features"]) == ("user-api", 48, 3)

    rows = client.metrics(job["id"])["items"]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert all(row["loss"] is not None and row["world_size"] == 2 for row in rows)
