"""How snapshot files travel between ranks, over the snapshots' own gloo group: a ring exchange with the buddies
(`exchange`), an all-gather of every rank's small file (`FileGather`), and one file sent to one rank (`send_file`,
`receive_file`), as a restore moves them."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ringmaster.workers.checkpoint.snapshots.shard_file import bytes_tensor


class FileGather:
    """Every rank's byte tensor (a shard file of a few KB, of a size that varies a little between steps), on every
    rank, in one all-gather: each sends its size and its content in a slot of a capacity the group agreed on. A
    content that does not fit is sent again, by every rank, in a slot grown to fit (with room to spare)."""

    HEADER, SPARE, ROUND = 8, 1.25, 4096

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group
        self._capacity = 0  # the same on every rank: it follows from what every rank gathered

    def __call__(self, content: torch.Tensor) -> list[torch.Tensor]:
        gathered = self._gather(content)
        sizes = [int.from_bytes(slot[: self.HEADER].numpy().tobytes(), "little") for slot in gathered]
        if max(sizes) > self._capacity:
            self._capacity = math.ceil(max(sizes) * self.SPARE / self.ROUND) * self.ROUND
            gathered = self._gather(content)
        return [slot[self.HEADER : self.HEADER + size] for slot, size in zip(gathered, sizes, strict=True)]

    def _gather(self, content: torch.Tensor) -> list[torch.Tensor]:
        slot = torch.zeros(self.HEADER + self._capacity, dtype=torch.uint8)
        slot[: self.HEADER] = bytes_tensor(content.numel().to_bytes(self.HEADER, "little"))
        if content.numel() <= self._capacity:
            slot[self.HEADER : self.HEADER + content.numel()] = content
        gathered = [torch.empty_like(slot) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(gathered, slot, group=self._group)
        return gathered


def exchange(
    payload: torch.Tensor, to: int, source: int, group: dist.ProcessGroup, allocate: Callable[[int], torch.Tensor]
) -> torch.Tensor:
    """Send `payload` to rank `to` while receiving one from rank `source` (every rank does so at once: a ring), into
    memory from `allocate`."""
    size_out, size_in = torch.tensor([payload.numel()], dtype=torch.int64), torch.empty(1, dtype=torch.int64)
    for request in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, size_out, to, group), dist.P2POp(dist.irecv, size_in, source, group)]
    ):
        request.wait()
    received = allocate(int(size_in.item()))
    for request in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, payload, to, group), dist.P2POp(dist.irecv, received, source, group)]
    ):
        request.wait()
    return received


def send_file(payload: torch.Tensor, destination: int, group: dist.ProcessGroup) -> None:
    """Send a byte tensor to rank `destination` (blocking): its size, then its content."""
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), destination, group=group)
    if payload.numel():
        dist.send(payload, destination, group=group)


def receive_file(source: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Receive what send_file sent from rank `source` (blocking)."""
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, source, group=group)
    content = torch.empty(int(size.item()), dtype=torch.uint8)
    if content.numel():
        dist.recv(content, source, group=group)
    return content
