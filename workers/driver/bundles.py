"""The one owner of a job attempt's placement-group bundles: the admission group the dispatcher reserved, and the
idle capacity reserved here for warm workers while the job runs. Every slot a worker or standby may take comes from
here, and everything here is released when the attempt ends."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.util import get_placement_group
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from ringmaster.service.naming import worker_bundles
from ringmaster.service.spec import WorkersSpec

log = logging.getLogger("ringmaster.driver")


@dataclass(frozen=True)
class Slot:
    """One bundle of a placement group: where one worker may run."""

    group: PlacementGroup
    index: int


def slot_nodes(slots: list[Slot]) -> list[str | None]:
    """The node each slot's bundle is placed on (None: not placed now)."""
    tables = {
        group: placement_group_table(group).get("bundles_to_node_id", {}) for group in {slot.group for slot in slots}
    }
    return [tables[slot.group].get(slot.index) for slot in slots]


def placed_slots(slots: list[Slot], excluded_nodes: set[str]) -> list[Slot]:
    """The slots whose bundle sits on a live node now (not one known to be lost)."""
    nodes = ray.nodes()  # type: ignore[no-untyped-call]  # Ray leaves it unannotated
    alive = {node["NodeID"] for node in nodes if node["Alive"]} - excluded_nodes
    return [slot for slot, node in zip(slots, slot_nodes(slots), strict=True) if node in alive]


class Bundles:
    def __init__(self, admission_group_name: str, workers: WorkersSpec) -> None:
        self._admission = get_placement_group(admission_group_name)
        self._workers = workers
        self.slots = [Slot(self._admission, index) for index in range(self._admission.bundle_count)]
        self._reserved: list[PlacementGroup] = []
        self._reserving: tuple[PlacementGroup, Any] | None = None  # a reservation and its ready() ref
        self.lost_nodes: set[str] = set()

    @property
    def admission(self) -> list[Slot]:
        return [slot for slot in self.slots if slot.group == self._admission]

    def free(self, taken: set[Slot]) -> list[Slot]:
        return [slot for slot in self.slots if slot not in taken]

    def spare(self, taken: set[Slot]) -> list[Slot]:
        """Free bundles that sit on live nodes now (Ray moved them after a node died, or capacity returned)."""
        return placed_slots(self.free(taken), self.lost_nodes)

    def spare_capacity(self) -> int:
        """How many more workers unreserved resources could hold now."""
        available = ray.available_resources()  # type: ignore[no-untyped-call]  # Ray leaves it unannotated
        if self._workers.gpus_per_worker:
            return int(available.get("GPU", 0) // self._workers.gpus_per_worker)
        return int(available.get("CPU", 0) // self._workers.cpus_per_worker)

    @property
    def reserving(self) -> bool:
        return self._reserving is not None

    def reserve(self, count: int) -> None:
        """Ask Ray for `count` more worker bundles on idle capacity (SPREAD); `reserved` hands them over once placed."""
        bundles = worker_bundles(self._workers.gpus_per_worker, self._workers.cpus_per_worker, count)
        group = placement_group(bundles, strategy="SPREAD")
        self._reserving = (group, group.ready())
        log.info("reserving idle capacity for %d warm worker(s)", count)

    def reserved(self) -> list[Slot]:
        """The slots of a reservation placed since the last call (now owned here like the admission's)."""
        if self._reserving is None or not ray.wait([self._reserving[1]], timeout=0)[0]:
            return []
        group, self._reserving = self._reserving[0], None
        self._reserved.append(group)
        added = [Slot(group, index) for index in range(group.bundle_count)]
        self.slots += added
        return added

    def cancel_reservation(self) -> None:
        """Free slots came first (Ray moved a lost node's bundles): a reservation still pending may never place."""
        if self._reserving is not None:
            remove_placement_group(self._reserving[0])
            self._reserving = None

    def release(self) -> None:
        for group in [self._admission, *self._reserved] + ([self._reserving[0]] if self._reserving else []):
            remove_placement_group(group)
        self._reserved, self._reserving = [], None
