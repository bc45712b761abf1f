"""Free capacity of one resource (GPUs or CPUs) across the nodes, bucketed by the amount each node has free.

A worker's bundle asks for one resource alone (service.naming.worker_bundles) and must fit on one node, so how many
workers of a shape the cluster holds is a sum over the distinct free amounts, not over the nodes: a cluster of 1,000
8-GPU nodes has at most 9 of them. Counting, packing and holding back capacity cost the number of distinct amounts
(and the nodes actually used), which keeps a pass over many queued jobs independent of the number of nodes.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# CPUs are fractional: sums and differences of them must not lose a worker to rounding.
EPSILON = 1e-9
_KEY_DIGITS = 6


def workers_in(amount: float, need: float) -> int:
    """How many bundles of `need` fit in `amount` of one resource."""
    return int(amount / need + EPSILON) if need > 0 else 0


class Pool:
    """One resource's free amount on each node; nodes that may not take new work (draining, gone) are left out."""

    def __init__(self, amounts: Sequence[float], placeable: Sequence[bool]) -> None:
        self.free = [float(amount) for amount in amounts]
        self._placeable = placeable
        self._buckets: dict[float, dict[int, None]] = {}  # free amount → its nodes, in the order they came
        self._amounts: list[float] = []  # the buckets' keys, ascending
        self._fitting: dict[float, int] = {}  # need → workers_fitting(need), until the next change
        self.total_free = 0.0  # over the placeable nodes: no set of bundles larger than this fits
        for node, amount in enumerate(self.free):
            if placeable[node]:
                self.total_free += amount
                key = round(amount, _KEY_DIGITS)
                if key > EPSILON:
                    bucket = self._buckets.get(key)
                    if bucket is None:
                        bucket = self._buckets[key] = {}
                    bucket[node] = None
        self._amounts = sorted(self._buckets)

    def _key(self, amount: float) -> float:
        return round(amount, _KEY_DIGITS)

    def _enter(self, node: int, amount: float) -> None:
        key = self._key(amount)
        if key <= EPSILON:
            return
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = {}
            bisect.insort(self._amounts, key)
        bucket[node] = None

    def _leave(self, node: int, amount: float) -> None:
        key = self._key(amount)
        bucket = self._buckets.get(key)
        if bucket is None or node not in bucket:
            return
        del bucket[node]
        if not bucket:
            del self._buckets[key]
            del self._amounts[bisect.bisect_left(self._amounts, key)]

    def placeable(self, node: int) -> bool:
        return node < len(self._placeable) and self._placeable[node]

    def change(self, node: int, delta: float) -> None:
        """Take (negative) or give back (positive) an amount on one node; a node that takes no new work keeps none."""
        if not self.placeable(node):
            return
        before = self.free[node]
        self._leave(node, before)
        self.free[node] = before + delta
        self.total_free += delta
        self._enter(node, self.free[node])
        self._fitting.clear()

    def workers_fitting(self, need: float) -> int:
        """How many bundles of `need` the free amounts hold, each on one node."""
        cached = self._fitting.get(need)
        if cached is not None:
            return cached
        total = 0
        if need > 0:
            buckets, amounts = self._buckets, self._amounts
            for index in range(bisect.bisect_left(amounts, need - EPSILON), len(amounts)):
                amount = amounts[index]
                total += len(buckets[amount]) * workers_in(amount, need)
        self._fitting[need] = total
        return total

    def place(self, need: float, count: int, preferred: Sequence[int] = ()) -> list[int]:
        """Take `count` bundles and return the node of each: first on `preferred` nodes (a growing job's own), then
        the whole remainder on the node it fits tightest, else the roomiest nodes first (fewest nodes) until it does.
        The caller has checked workers_fitting(need) >= count."""
        placed: list[int] = []
        for node in dict.fromkeys(preferred):
            if len(placed) == count:
                break
            if self.placeable(node):
                here = min(workers_in(self.free[node], need), count - len(placed))
                if here > 0:
                    self.change(node, -here * need)
                    placed.extend([node] * here)
        while len(placed) < count:
            remaining = count - len(placed)
            amounts = self._amounts
            tightest = bisect.bisect_left(amounts, remaining * need - EPSILON)
            if tightest < len(amounts):
                node, here = next(iter(self._buckets[amounts[tightest]])), remaining
            else:
                node = next(iter(self._buckets[amounts[-1]]))
                here = workers_in(self.free[node], need)
                if here == 0:
                    raise ValueError(
                        f"{remaining} more bundles of {need:g} do not fit: workers_fitting was not checked"
                    )
            self.change(node, -here * need)
            placed.extend([node] * here)
        return placed

    def hold_back(self, need: float) -> float:
        """Hold every whole bundle of `need` now free (a reservation for a job that needs more than that): later jobs
        of this pass take only what remains. Returns the amount held."""
        held = 0.0
        start = bisect.bisect_left(self._amounts, need - EPSILON)
        nodes = [node for amount in self._amounts[start:] for node in self._buckets[amount]]
        for node in nodes:
            amount = workers_in(self.free[node], need) * need
            self.change(node, -amount)
            held += amount
        return held
