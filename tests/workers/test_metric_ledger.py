"""Rank 0's metric points kept for checkpoints until the control plane acknowledges them."""

from __future__ import annotations

import json

from ringmaster.service.reports import MetricPoint
from ringmaster.workers.metric_ledger import RankMetrics


def test_a_checkpoint_keeps_the_unacknowledged_points_in_order_as_a_list_and_as_json() -> None:
    sent: list[MetricPoint] = []
    acknowledged = [0]
    metrics = RankMetrics(3, sent.append, lambda: acknowledged[0], keep_for_checkpoints=True)
    for step in range(1, 6):
        metrics.record(MetricPoint(step=step, loss=1.0 / step))
    metrics.replay([{"step": 6, "loss": 0.5, "attempt": 2}])
    assert [point.step for point in sent] == [1, 2, 3, 4, 5, 6]

    acknowledged[0] = 2  # the first two points sent are stored
    kept = metrics.for_checkpoint()
    assert [(point["step"], point["attempt"]) for point in kept] == [(3, 3), (4, 3), (5, 3), (6, 2)]
    assert kept[0] == {"attempt": 3, "step": 3, "loss": 1.0 / 3}
    assert json.loads(metrics.for_checkpoint_json()) == kept

    acknowledged[0] = 6
    assert metrics.for_checkpoint() == [] and json.loads(metrics.for_checkpoint_json()) == []
    metrics.record(MetricPoint(step=7, loss=0.25))
    assert json.loads(metrics.for_checkpoint_json()) == [{"attempt": 3, "step": 7, "loss": 0.25}]


def test_nothing_is_kept_without_checkpoints_to_keep_it() -> None:
    metrics = RankMetrics(1, lambda point: None, lambda: 0, keep_for_checkpoints=False)
    metrics.record(MetricPoint(step=1, loss=1.0))
    assert metrics.for_checkpoint() == [] and metrics.for_checkpoint_json() == "[]"


def test_a_held_point_takes_its_steps_later_values_and_is_sent_once_in_its_place() -> None:
    sent: list[MetricPoint] = []
    acknowledged = [0]
    metrics = RankMetrics(1, sent.append, lambda: acknowledged[0], keep_for_checkpoints=True)
    metrics.record(MetricPoint(step=1, loss=2.0), hold=True)
    assert sent == [] and metrics.for_checkpoint() == [{"attempt": 1, "step": 1, "loss": 2.0}], "kept while held"

    metrics.record(MetricPoint(step=1, val_loss=2.5))  # the step's validation
    assert sent == [] and metrics.for_checkpoint() == [{"attempt": 1, "step": 1, "loss": 2.0, "val_loss": 2.5}]
    metrics.release()
    metrics.release()  # nothing held: nothing sent
    assert sent == [MetricPoint(step=1, loss=2.0, val_loss=2.5)]

    metrics.record(MetricPoint(step=2, loss=1.5), hold=True)
    metrics.record(MetricPoint(step=3, loss=1.0))  # another step's point sends the held one first
    assert [(point.step, point.val_loss) for point in sent] == [(1, 2.5), (2, None), (3, None)]
    acknowledged[0] = 2  # one acknowledgement per point sent: the merged validation took no place of its own
    assert [point["step"] for point in metrics.for_checkpoint()] == [3]


def test_a_checkpoint_keeps_the_loss_fns_own_metrics_and_a_resumed_attempt_replays_them() -> None:
    metrics = RankMetrics(1, lambda point: None, lambda: 0, keep_for_checkpoints=True)
    metrics.record(MetricPoint(step=1, loss=1.0, user_metrics={"accuracy": 0.5}), hold=True)
    # The step's validation merges in, keeping them beside its own over the validation set.
    metrics.record(MetricPoint(step=1, val_loss=2.0, user_metrics={"val_accuracy": 0.25}))
    kept = json.loads(metrics.for_checkpoint_json())
    both = {"accuracy": 0.5, "val_accuracy": 0.25}
    assert kept == [{"attempt": 1, "step": 1, "loss": 1.0, "val_loss": 2.0, "user_metrics": both}]
    replayed: list[MetricPoint] = []
    RankMetrics(2, replayed.append, lambda: 0, keep_for_checkpoints=True).replay(kept)
    assert [(point.attempt, point.user_metrics) for point in replayed] == [(1, both)]
