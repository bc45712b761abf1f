"""Each private torch API behind workers/torch_internals.py keeps the meaning ringmaster relies on: a torch release
that moves or changes one fails here, by name."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.device_mesh import init_device_mesh

from ringmaster.workers import torch_internals

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_torch_is_in_the_tested_range() -> None:
    import tomllib

    requirements = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [torch_requirement] = [r for r in requirements if r.startswith("torch")]
    assert SpecifierSet(torch_requirement.removeprefix("torch")) == SpecifierSet(torch_internals.TESTED_TORCH)
    assert Version(torch.__version__).base_version in SpecifierSet(torch_internals.TESTED_TORCH)


def test_narrow_to_chunk_is_the_chunk_at_offsets() -> None:
    tensor = torch.arange(24.0).reshape(4, 6)
    chunk = torch_internals.narrow_to_chunk(tensor, [1, 2], [2, 3])
    assert torch.equal(chunk, tensor[1:3, 2:5])
    assert chunk.data_ptr() == tensor[1:3, 2:5].data_ptr()  # a view, not a copy


def _saved(tmp_path: Path) -> FileSystemReader:
    dcp.save({"model": {"w": torch.ones(3)}, "extra": {"step": 3, "names": ["a"]}}, checkpoint_id=tmp_path)
    return FileSystemReader(tmp_path)


def test_planner_set_value_reaches_the_nested_state_dict(tmp_path: Path) -> None:
    reader = _saved(tmp_path)
    state = {"model": {"w": torch.zeros(3)}, "extra": {"step": 0, "names": []}}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, reader.read_metadata(), is_coordinator=True)
    byte_items = [item.dest_index.fqn for item in planner.create_local_plan().items if item.type.name == "BYTE_IO"]
    assert set(byte_items) == {"extra.step", "extra.names"}
    torch_internals.planner_set_value(planner, "extra.step", 7)
    assert state["extra"]["step"] == 7


def test_planner_set_value_without_flattening(tmp_path: Path) -> None:
    dcp.save({"step": 3}, checkpoint_id=tmp_path)
    state = {"step": 0}
    planner = DefaultLoadPlanner(flatten_state_dict=False)
    planner.set_up_planner(state, FileSystemReader(tmp_path).read_metadata(), is_coordinator=True)
    torch_internals.planner_set_value(planner, "step", 9)
    assert planner.state_dict["step"] == 9  # where load_bytes puts it: the planner's own flat copy


def test_fsspec_storage_round_trips_a_checkpoint(tmp_path: Path) -> None:
    saved = {"w": torch.randn(4, 4), "step": 5}
    dcp.save(saved, storage_writer=torch_internals.FsspecWriter(f"file://{tmp_path}"))
    loaded = {"w": torch.zeros(4, 4), "step": 0}
    dcp.load(loaded, storage_reader=torch_internals.FsspecReader(f"file://{tmp_path}"))
    assert torch.equal(loaded["w"], saved["w"]) and loaded["step"] == 5


@pytest.fixture
def one_rank_group() -> Iterator[timedelta]:
    assert not dist.is_initialized()
    timeout = timedelta(seconds=123)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    try:
        yield timeout
    finally:
        dist.destroy_process_group()


def test_default_group_timeout_is_the_one_the_group_was_formed_with(one_rank_group: timedelta) -> None:
    assert torch_internals.default_group_timeout(torch.device("cpu")) == one_rank_group


def test_default_group_timeout_without_a_group() -> None:
    assert not dist.is_initialized()
    assert torch_internals.default_group_timeout(torch.device("cpu")) is None


def test_replicate_trains_as_the_plain_module(one_rank_group: timedelta) -> None:
    torch.manual_seed(0)
    plain = nn.Linear(4, 2)
    replicated = torch_internals.replicate(copy.deepcopy(plain), mesh=init_device_mesh("cpu", (1,)))
    batch = torch.randn(8, 4)
    plain(batch).square().sum().backward()
    replicated(batch).square().sum().backward()
    for ours, theirs in zip(plain.parameters(), replicated.parameters(), strict=True):
        assert theirs.grad is not None and ours.grad is not None
        grad = theirs.grad.full_tensor() if hasattr(theirs.grad, "full_tensor") else theirs.grad
        torch.testing.assert_close(grad, ours.grad)


class _CountedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return torch.tanh(self.linear(x))


def test_composable_checkpoint_recomputes_the_block_in_backward() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(_CountedBlock(), nn.Linear(4, 1))
    checkpointed = copy.deepcopy(plain)
    torch_internals.composable_checkpoint(checkpointed[0])
    batch = torch.randn(5, 4)
    plain(batch).sum().backward()
    checkpointed(batch).sum().backward()
    assert (plain[0].forwards, checkpointed[0].forwards) == (1, 2)  # the checkpointed block runs again in backward
    for ours, theirs in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(theirs.grad, ours.grad)
    assert dict(checkpointed.state_dict()).keys() == dict(plain.state_dict()).keys()  # names stay the model's own


def test_foreach_kernels_match_one_tensor_at_a_time() -> None:
    tensors = [torch.randn(3), torch.randn(2, 2)]
    norms = torch_internals.foreach_norm(tensors, 2.0)
    assert [float(n) for n in norms] == pytest.approx([float(t.norm()) for t in tensors])
    scaled = [t.clone() for t in tensors]
    torch_internals.foreach_mul_(scaled, torch.tensor(0.5))
    for before, after in zip(tensors, scaled, strict=True):
        assert torch.equal(after, before * 0.5)
    targets = [torch.zeros_like(t) for t in tensors]
    torch_internals.foreach_copy_(targets, tensors)
    assert all(torch.equal(a, b) for a, b in zip(targets, tensors, strict=True))


def test_tree_map_maps_tensors_inside_containers() -> None:
    mapped = torch_internals.tree_map(lambda v: v * 2 if isinstance(v, torch.Tensor) else v, ([torch.ones(1)], "x"))
    assert torch.equal(mapped[0][0], torch.full((1,), 2.0)) and mapped[1] == "x"


def test_the_default_group_timeout_can_be_changed_after_formation(one_rank_group: timedelta) -> None:
    torch_internals.set_default_group_timeout(timedelta(seconds=45))
    assert torch_internals.default_group_timeout(torch.device("cpu")) == timedelta(seconds=45)


def test_groups_made_counts_each_group_and_can_be_taken_back() -> None:
    before = torch_internals.groups_made()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert torch_internals.groups_made() == before + 1
        dist.new_group([0])
        assert torch_internals.groups_made() == before + 2
        torch_internals.set_groups_made(before + 1)
        assert torch_internals.groups_made() == before + 1
    finally:
        dist.destroy_process_group()


def test_import_dynamo_loads_it() -> None:
    import sys

    torch_internals.import_dynamo()
    assert "torch._dynamo" in sys.modules


def test_mem_tracker_sees_a_module_s_parameters() -> None:
    model = nn.Linear(256, 256)
    tracker = torch_internals.MemTracker()
    tracker.track_external(model)
    with tracker:
        model(torch.randn(4, 256)).sum().backward()
    peak = max(tracker.get_tracker_snapshot("peak")[torch.device("cpu")].values())
    assert peak >= 256 * 256 * 4  # at least the weight's bytes
