"""A snapshot's shard file: a rank's items as raw bytes, where DCP's own file writers serialise every tensor with
torch.save (most of a small model's snapshot time). The tensors lie one after another, each at a multiple of
`_ALIGNMENT` (so it can be viewed as any dtype), then one pickled table of the byte items (DCP's name for non-tensor
values), then the table's length in 8 bytes. The metadata names each item's `RawSlot`. The memory of files a rank let
go is reused for the next ones (`FileBuffers`)."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

_ALIGNMENT = 16  # every item starts at a multiple of this in its shard file, so it can be viewed as any dtype


@dataclass(frozen=True)
class RawSlot:
    """Where one item of a snapshot lies in a rank's shard file: a tensor's byte range, dtype and shape, or a byte
    item's (DCP's name for a non-tensor value) key in the file's table of pickled values."""

    relative_path: str
    offset: int = 0
    length: int = 0
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None
    key: int | None = None
    copies: tuple[RawSlot, ...] = ()  # the same item in other ranks' files (it is replicated across nodes)

    def files(self) -> tuple[str, ...]:
        """Every file that holds this item; any one of them will do."""
        return tuple(sorted({self.relative_path, *(copy.relative_path for copy in self.copies)}))


# A rank's two shard files of a snapshot, by the part of its items each holds: the items no rank on another node
# holds (its own shards, RNG states, metric points), of which its buddies keep a copy; and its share of the items
# ranks on other nodes hold too (replicas), which stay home.
UNIQUE_PART, REPLICATED_PART = 0, 1


def shard_name(rank: int, part: int = UNIQUE_PART) -> str:
    return f"__{rank}_{part}.distcp"


def file_slots(items: list[WriteItem], tensors: dict[int, torch.Tensor], name: str) -> tuple[list[RawSlot], int]:
    """Where each of `items` lies in shard file `name`: the tensors among them (`tensors`, by item position) one after
    another, then a table of the byte items by position. Returns the slots and the tensors' length in bytes."""
    slots, offset = [], 0
    for key in range(len(items)):
        if key not in tensors:
            slots.append(RawSlot(name, key=key))
            continue
        tensor = tensors[key]
        length = tensor.numel() * tensor.element_size()
        slots.append(RawSlot(name, offset, length, tensor.dtype, tuple(tensor.shape)))
        offset += length + (-length % _ALIGNMENT)
    return slots, offset


def new_shard_file(
    tensor_bytes: int,
    values: dict[int, Any],
    allocate: Callable[[int], torch.Tensor] = lambda size: torch.empty(size, dtype=torch.uint8),
) -> torch.Tensor:
    """A shard file with room for `tensor_bytes` of tensors, then the pickled table of byte items and its length."""
    return shard_file_with_table(tensor_bytes, pickle.dumps(values), allocate)


def shard_file_with_table(
    tensor_bytes: int,
    table: bytes,
    allocate: Callable[[int], torch.Tensor] = lambda size: torch.empty(size, dtype=torch.uint8),
) -> torch.Tensor:
    content = allocate(tensor_bytes + len(table) + 8)
    content[tensor_bytes:].copy_(bytes_tensor(table + len(table).to_bytes(8, "little")))
    return content


class FileBuffers:
    """The memory of the snapshot files this rank no longer keeps, reused for the next ones: a fresh buffer of a
    model's size pays its page faults at every step, more than the copy into it costs. Files are views of a
    buffer with room to spare (the table of byte items varies a little in size between steps)."""

    SPARE = 64 * 1024

    def __init__(self) -> None:
        self._free: dict[str, list[torch.Tensor]] = {}
        self._used: dict[str, list[tuple[str, torch.Tensor]]] = {}  # location -> (file name, buffer)

    def allocator(self, location: str, name: str) -> Callable[[int], torch.Tensor]:
        def allocate(size: int) -> torch.Tensor:
            free = self._free.get(name, [])
            buffer = free.pop() if free else None
            if buffer is None or buffer.numel() < size:
                buffer = torch.empty(size + self.SPARE, dtype=torch.uint8)
            self._used.setdefault(location, []).append((name, buffer))
            return buffer[:size]

        return allocate

    def release(self, kept: set[str]) -> None:
        """Free the buffers of every snapshot location not in `kept` (the store no longer holds it)."""
        for location in [location for location in self._used if location not in kept]:
            for name, buffer in self._used.pop(location):
                self._free.setdefault(name, []).append(buffer)


def slot_view(content: torch.Tensor, slot: RawSlot) -> torch.Tensor:
    # Only a tensor item's slot is viewed, and file_slots gives it a dtype and a shape.
    dtype, shape = cast(torch.dtype, slot.dtype), cast(tuple[int, ...], slot.shape)
    return content[slot.offset : slot.offset + slot.length].view(dtype).view(shape)


def resolved_tensor(planner: DefaultSavePlanner, item: WriteItem) -> torch.Tensor:
    """A tensor item's data, detached (resolve_data gives a tensor for every item but a byte item)."""
    return cast(torch.Tensor, planner.resolve_data(item)).detach()


def build_shard_file(
    items: list[WriteItem], planner: DefaultSavePlanner, name: str
) -> tuple[torch.Tensor, list[WriteResult]]:
    """A rank's shard file: its tensors' raw bytes one after another, then one pickled table of its byte items (an
    optimizer hyperparameter, the progress, an RNG state: DCP's own resolve_data runs torch.save for each, and a
    model's optimizer has hundreds), then the table's length."""
    tensors = {
        key: resolved_tensor(planner, item) for key, item in enumerate(items) if item.type != WriteItemType.BYTE_IO
    }
    slots, tensor_bytes = file_slots(items, tensors, name)
    content = new_shard_file(
        tensor_bytes,
        {
            key: planner.lookup_object(item.index)
            for key, item in enumerate(items)
            if item.type == WriteItemType.BYTE_IO
        },
    )
    for key, tensor in tensors.items():
        slot_view(content, slots[key]).copy_(tensor)
    return content, [
        WriteResult(index=item.index, size_in_bytes=slot.length, storage_data=slot)
        for item, slot in zip(items, slots, strict=True)
    ]


def open_shard_file(content: torch.Tensor) -> tuple[torch.Tensor, dict[int, Any]]:
    """A shard file's tensor bytes and its table of byte items."""
    size = int.from_bytes(content[-8:].numpy().tobytes(), "little")
    return content[: -8 - size], pickle.loads(content[-8 - size : -8].numpy().data)


def bytes_tensor(content: bytes) -> torch.Tensor:
    """`content` as a byte tensor (a copy: the tensor is writable)."""
    return torch.frombuffer(bytearray(content), dtype=torch.uint8) if content else torch.empty(0, dtype=torch.uint8)
