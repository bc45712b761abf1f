"""A group's snapshot layout: while the live state keeps its structure, which items each of a rank's shard files
holds, where each lies in it, and where each value comes from at a step (views of the live tensors, the step's own
values, an optimizer's hyperparameters), so a snapshot is a copy into the file with no DCP planning. A fingerprint of
the state's structure and storage says whether the layout still holds."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.optim import Optimizer

from ringmaster.workers.checkpoint.snapshots.shard_file import RawSlot, file_slots, resolved_tensor, slot_view
from ringmaster.workers.checkpoint.snapshots.store import SNAPSHOTS_KEPT
from ringmaster.workers.strategies.parallel_model import local_tensor
from ringmaster.workers.torch_internals import foreach_copy_


@dataclass(frozen=True)
class FileLayout:
    """One of a rank's shard files while the state keeps its structure: its items and their slots, and where each
    item's value comes from at a step. `live`: views of the live parameters, module buffers and optimizer state
    (valid while the layout's state fingerprint holds); `at_boundary`: the live items the next forward may change
    (module buffers), copied before it starts, the rest only the optimizer changes; `step_values`: items the step's
    own values give (progress, RNG states, metric points); `hyperparameters`: byte items that are an optimizer's
    hyperparameter (the learning rate changes every step), as (optimizer, group, name). `reusable`: every item has a
    source here."""

    name: str
    items: list[WriteItem]
    slots: list[RawSlot]
    tensor_bytes: int
    live: dict[int, torch.Tensor]
    at_boundary: frozenset[int]
    step_values: tuple[int, ...]
    hyperparameters: dict[int, tuple[int, int, str]]
    reusable: bool
    # Views of the slots in each file buffer this layout has filled, by the buffer's address: the buffers are reused
    # (FileBuffers), and making a hundred views costs more than copying a small model's state into them. A cached
    # view keeps its buffer alive, so no other buffer can take its address; the oldest entry goes when a buffer
    # beyond the SNAPSHOTS_KEPT + 1 in use comes (one FileBuffers replaced with a larger one).
    _views: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict, compare=False, repr=False)

    def slot_views(self, content: torch.Tensor) -> dict[int, torch.Tensor]:
        """Item position -> a view of its slot in file `content`, for every tensor item."""
        views = self._views.get(content.data_ptr())
        if views is None:
            views = {key: slot_view(content, slot) for key, slot in enumerate(self.slots) if slot.key is None}
            if len(self._views) > SNAPSHOTS_KEPT:  # the buffers in use: the kept snapshots' and the one being written
                del self._views[next(iter(self._views))]
            self._views[content.data_ptr()] = views
        return views

    def copy_live(self, content: torch.Tensor, *, at_boundary: bool) -> None:
        """Copy the live items that change at the boundary (module buffers), or the rest, into file `content`."""
        keys, sources = self.live_by_boundary[at_boundary]
        if keys:
            views = self.slot_views(content)
            foreach_copy_([views[key] for key in keys], sources)

    @cached_property
    def live_by_boundary(self) -> dict[bool, tuple[list[int], list[torch.Tensor]]]:
        """Whether copied at the boundary -> those live items' positions and views (fixed for the layout)."""
        split: dict[bool, tuple[list[int], list[torch.Tensor]]] = {True: ([], []), False: ([], [])}
        for key, view in self.live.items():
            keys, sources = split[key in self.at_boundary]
            keys.append(key)
            sources.append(view)
        return split


@dataclass(frozen=True)
class SnapshotLayout:
    """What a group's snapshots share while the state keeps its structure: this rank's files, the snapshots'
    metadata, and the fingerprints of the live state (fingerprint_of_state) and of the step's own values
    (fingerprint_of_step_values) when the layout was made."""

    state_fingerprint: list[Any]
    step_values_fingerprint: list[Any]
    metadata: bytes
    files: tuple[FileLayout, ...]

    @property
    def reusable(self) -> bool:
        return all(file.reusable for file in self.files)


def fingerprint_of_state(model_parts: list[nn.Module], optimizers: list[Optimizer]) -> list[Any]:
    """The structure and storage of a rank's live parameters, buffers and optimizer state: equal at two steps when
    a snapshot's items come from the same places (it costs about a microsecond per tensor)."""
    entries: list[Any] = []
    for part in model_parts:
        for tensor in itertools.chain(part.parameters(), part.buffers()):
            local = local_tensor(tensor)
            entries.append((local.data_ptr(), local.shape, local.dtype))
    for local_optim in optimizers:
        for group in local_optim.param_groups:
            entries.append(
                [len(group["params"])]
                + [
                    (name, (value.data_ptr(), value.shape) if isinstance(value, torch.Tensor) else value)
                    for name, value in group.items()
                    if name not in ("params", "lr")
                ]
            )
            for parameter in group["params"]:
                for name, value in local_optim.state.get(parameter, {}).items():
                    if isinstance(value, torch.Tensor):
                        local = local_tensor(value)
                        entries.append((name, local.data_ptr(), local.shape, local.dtype))
                    else:
                        entries.append((name, value))
    return entries


def fingerprint_of_step_values(values: dict[str, Any]) -> list[Any]:
    """The structure of the step's own values (flattened): fixed for a rank within a group (its RNG states, the
    progress, rank 0's metric points as one value)."""
    return [
        (key, value.shape, value.dtype) if isinstance(value, torch.Tensor) else key for key, value in values.items()
    ]


def live_storages(model_parts: list[nn.Module], optimizers: list[Optimizer]) -> dict[int, bool]:
    """The storage of every live parameter, module buffer and optimizer state tensor -> whether it is a buffer."""
    storages: dict[int, bool] = {}
    for part in model_parts:
        storages.update((local_tensor(tensor).untyped_storage().data_ptr(), False) for tensor in part.parameters())
        storages.update((local_tensor(tensor).untyped_storage().data_ptr(), True) for tensor in part.buffers())
    for local_optim in optimizers:
        for state in local_optim.state.values():
            storages.update(
                (local_tensor(value).untyped_storage().data_ptr(), False)
                for value in state.values()
                if isinstance(value, torch.Tensor)
            )
    return storages


def hyperparameter_sources(
    optimizer_state: dict[str, Any], optimizers: list[Optimizer]
) -> dict[str, tuple[int, int, str]]:
    """Flattened key of each hyperparameter in `optimizer_state` (training_state's flattened optimizer state, whose
    "state.{fqn}.{name}" values are the optimizers' own tensors) -> (optimizer, group, name) it is read from. A
    parameter with no state tensor has no entry."""
    owners: dict[int, tuple[int, int, str]] = {}
    for index, local_optim in enumerate(optimizers):
        for group_index, group in enumerate(local_optim.param_groups):
            for parameter in group["params"]:
                owners.update(
                    (id(value), (index, group_index, name))
                    for name, value in local_optim.state.get(parameter, {}).items()
                    if isinstance(value, torch.Tensor)
                )
    groups: dict[str, tuple[int, int]] = {}
    for key, value in optimizer_state.items():
        if key.startswith("state.") and id(value) in owners:
            index, group_index, name = owners[id(value)]
            groups[key[len("state.") : -len(name) - 1]] = (index, group_index)
    sources = {}
    for key in optimizer_state:
        if key.startswith("param_groups."):
            fqn, name = key[len("param_groups.") :].rsplit(".", 1)
            if fqn in groups:
                sources[f"optimizer.{key}"] = (*groups[fqn], name)
    return sources


def _file_layout(
    name: str,
    items: list[WriteItem],
    planner: DefaultSavePlanner,
    storages: dict[int, bool],
    hyperparameters: dict[str, tuple[int, int, str]],
) -> FileLayout:
    tensors = {
        key: resolved_tensor(planner, item) for key, item in enumerate(items) if item.type != WriteItemType.BYTE_IO
    }
    slots, tensor_bytes = file_slots(items, tensors, name)
    live, at_boundary, step_values, from_hyperparameters, reusable = {}, set(), [], {}, True
    for key, item in enumerate(items):
        if item.index.fqn.split(".", 1)[0] not in ("model", "optimizer"):
            step_values.append(key)
        elif key in tensors:
            storage = tensors[key].untyped_storage().data_ptr()
            if tensors[key].numel() == 0:
                continue  # nothing to copy
            if storage not in storages:
                reusable = False  # a copy, not a view of the live state
                continue
            live[key] = tensors[key]
            if storages[storage]:
                at_boundary.add(key)
        elif item.index.fqn in hyperparameters:
            from_hyperparameters[key] = hyperparameters[item.index.fqn]
        else:
            reusable = False
    return FileLayout(
        name,
        items,
        slots,
        tensor_bytes,
        live,
        frozenset(at_boundary),
        tuple(step_values),
        from_hyperparameters,
        reusable,
    )


def make_layout(
    state_fingerprint: list[Any],
    step_values_fingerprint: list[Any],
    files: list[tuple[str, list[WriteItem]]],
    metadata: bytes,
    state: dict[str, Any],
    storages: dict[int, bool],
    hyperparameters: dict[str, tuple[int, int, str]],
) -> SnapshotLayout:
    """The layout a full save left: `state`, the state dict it saved (views of the live tensors), `files`, the items
    of each shard file this rank wrote (SnapshotWriter.files)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state)
    files_layout = tuple(_file_layout(name, items, planner, storages, hyperparameters) for name, items in files)
    return SnapshotLayout(state_fingerprint, step_values_fingerprint, metadata, files_layout)


def items_of_step(
    file: FileLayout, values: DefaultSavePlanner, optimizers: list[Optimizer]
) -> tuple[dict[int, Any], dict[int, torch.Tensor]]:
    """What of shard file `file` a step gives besides the live tensors: its byte items (the step's own values and the
    optimizers' hyperparameters), by position, and the step's own tensors (RNG states), by position."""
    items = file.items
    table = {
        key: values.lookup_object(items[key].index)
        for key in file.step_values
        if items[key].type == WriteItemType.BYTE_IO
    }
    table.update(
        (key, optimizers[index].param_groups[group][name]) for key, (index, group, name) in file.hyperparameters.items()
    )
    tensors = {
        key: values.lookup_object(items[key].index)
        for key in file.step_values
        if items[key].type != WriteItemType.BYTE_IO
    }
    return table, tensors
