"""Every private torch API ringmaster relies on, each behind one small function or name, for the torch range that
pyproject.toml allows (`TESTED_TORCH`).

torch gives no promise about names with a leading underscore. tests/workers/test_torch_internals.py checks each one here
against its meaning, so a torch release that moves or changes one fails there, by name, rather than deep inside a
recovery or a checkpoint restore.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.utils._pytree import tree_map

TESTED_TORCH = ">=2.13,<2.14"  # keep equal to the torch requirement in pyproject.toml

__all__ = [
    "TESTED_TORCH",
    "FsspecReader",
    "FsspecWriter",
    "MemTracker",
    "composable_checkpoint",
    "default_group_timeout",
    "foreach_copy_",
    "foreach_mul_",
    "foreach_norm",
    "groups_made",
    "import_dynamo",
    "narrow_to_chunk",
    "planner_set_value",
    "replicate",
    "set_default_group_timeout",
    "set_groups_made",
    "tree_map",
]


def narrow_to_chunk(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The view of `tensor` at `offsets` of size `lengths` in every dimension (a DCP read item's chunk)."""
    return narrow_tensor_by_index(tensor, offsets, lengths)


def planner_set_value(planner: DefaultLoadPlanner, fqn: str, value: Any) -> None:
    """Put a loaded non-tensor value where DCP's default load planner's `load_bytes` would, without its unpickling:
    into the caller's nested state dict when the planner flattened it, else into its flat one."""
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


def default_group_timeout(device: torch.device) -> timedelta | None:
    """The default process group's collective timeout; None where its backend does not expose one."""
    try:
        group = dist.group.WORLD
        if group is None:
            return None
        timeout: timedelta = group._get_backend(device).options._timeout
        return timeout
    except (AttributeError, RuntimeError):
        return None


def set_default_group_timeout(timeout: timedelta) -> None:
    """Give the default process group's collectives `timeout` from now on (it was formed with another)."""
    distributed_c10d._set_pg_timeout(timeout)


def groups_made() -> int:
    """How many process groups this process has made: a new group's name, under which its members meet in the
    store, counts them."""
    count: int = distributed_c10d._world.group_count
    return count


def set_groups_made(count: int) -> None:
    """Take back the count of an init that failed, so the next one meets its peers under the name they use."""
    distributed_c10d._world.group_count = count


def import_dynamo() -> None:
    """Import torch._dynamo, which DistributedDataParallel imports on construction (seconds, on a cold process)."""
    import torch._dynamo  # noqa: F401


# The foreach kernels torch's own optimizers and get_total_norm call: one kernel over a list of tensors, without a
# Python call per tensor.
foreach_copy_: Callable[[list[torch.Tensor], list[torch.Tensor]], None] = torch._foreach_copy_
foreach_mul_: Callable[[list[torch.Tensor], torch.Tensor], None] = torch._foreach_mul_
foreach_norm: Callable[[list[torch.Tensor], float], tuple[torch.Tensor, ...]] = torch._foreach_norm
