"""The free-capacity index: counting bundles per free amount, packing a gang tightly, holding capacity back."""

from __future__ import annotations

from ringmaster.service.scheduling.capacity import Pool, workers_in


def test_counts_bundles_per_node_not_per_total() -> None:
    pool = Pool([3, 3, 8, 0], [True, True, True, True])
    assert pool.workers_fitting(4) == 2  # two 3-GPU nodes hold no 4-GPU bundle, the 8-GPU node holds two
    assert pool.workers_fitting(1) == 14
    assert pool.total_free == 14


def test_a_gang_goes_to_the_node_it_fits_tightest() -> None:
    pool = Pool([8, 2, 4, 3], [True, True, True, True])
    assert pool.place(1, 3) == [3, 3, 3]
    assert pool.free == [8, 2, 4, 0]


def test_a_gang_larger_than_any_node_spans_the_roomiest_nodes_first() -> None:
    pool = Pool([8, 2, 4, 3], [True, True, True, True])
    assert pool.place(1, 11) == [0] * 8 + [3] * 3  # 8 on the roomiest, the remaining 3 where they fit tightest
    assert pool.workers_fitting(1) == 6


def test_a_drained_node_is_never_counted_nor_used() -> None:
    pool = Pool([8, 8], [True, False])
    assert pool.workers_fitting(1) == 8
    pool.change(1, 4)
    assert pool.free[1] == 8 and pool.workers_fitting(1) == 8


def test_fractional_cpus_do_not_lose_a_bundle_to_rounding() -> None:
    assert workers_in(0.9, 0.3) == 3
    pool = Pool([0.9], [True])
    assert pool.place(0.3, 3) == [0, 0, 0]
    assert pool.workers_fitting(0.3) == 0


def test_holding_back_keeps_whole_bundles_and_leaves_fragments() -> None:
    pool = Pool([5, 3, 2], [True, True, True])
    assert pool.hold_back(2) == 8  # 4 of the 5, 2 of the 3, both of the 2
    assert pool.free == [1, 1, 0]
    assert pool.workers_fitting(1) == 2 and pool.workers_fitting(2) == 0
