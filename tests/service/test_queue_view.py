"""The queue view on both databases: plan order with unplanned jobs last, a tenant's slice with global positions, each
tenant's standing from the newest share sample, the share series thinned for a chart, and the series' retention."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any

from sqlalchemy import select

from ringmaster.service import queue_view, tenants
from ringmaster.service.auth import Principal
from ringmaster.service.db import Database, session_scope
from ringmaster.service.jobs import cancel_job, submit_job
from ringmaster.service.models import Job, TenantShare
from ringmaster.service.queue_view import ShareSample
from ringmaster.service.spec import JobSpec

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def _submit(db: Database, name: str, tenant: str = "team-a", **fields: Any) -> str:
    spec = JobSpec.model_validate({"name": name, "model": "mlp", **fields})
    with session_scope(db.sessions) as session:
        tenants.ensure_tenant(session, tenant)
        return submit_job(session, spec, principal=Principal(tenant, admin=False)).id


def _plan(db: Database, positions: dict[str, int | None], reasons: dict[str, str] | None = None) -> None:
    """What the dispatcher writes after a pass: each queued job's place and why it waits."""
    with session_scope(db.sessions) as session:
        for job_id, position in positions.items():
            job = session.get(Job, job_id)
            assert job is not None
            job.queue_position = position
            job.waiting_reason = (reasons or {}).get(job_id)


def _ids(page: queue_view.QueuePage) -> list[str]:
    return [job.id for job in page.items]


def test_queued_jobs_come_in_plan_order_and_unplanned_ones_last_by_priority_then_age(db: Database) -> None:
    first, second, third = _submit(db, "first"), _submit(db, "second"), _submit(db, "third")
    unplanned_low, unplanned_high = _submit(db, "late-low"), _submit(db, "late-high", priority=5)
    finished = _submit(db, "gone")
    _plan(db, {third: 1, first: 2, second: 3, finished: 4})
    with session_scope(db.sessions) as session:
        cancel_job(session, finished)
    with session_scope(db.sessions) as session:
        page = queue_view.queue_page(session, tenant=None, limit=100, offset=0)
    assert _ids(page) == [third, first, second, unplanned_high, unplanned_low]
    assert page.total == 5
    assert [job.position for job in page.items] == [1, 2, 3, None, None]


def test_a_page_is_a_slice_of_the_order_with_the_whole_count(db: Database) -> None:
    ids = [_submit(db, f"job-{index}") for index in range(5)]
    _plan(db, {job_id: 5 - index for index, job_id in enumerate(ids)})
    with session_scope(db.sessions) as session:
        page = queue_view.queue_page(session, tenant=None, limit=2, offset=1)
    assert _ids(page) == [ids[3], ids[2]] and page.total == 5 and (page.limit, page.offset) == (2, 1)


def test_pages_across_the_placed_and_unplaced_jobs_follow_one_order(db: Database) -> None:
    placed = [_submit(db, f"placed-{index}") for index in range(3)]
    unplaced = [_submit(db, f"late-{index}") for index in range(3)]
    _plan(db, {job_id: index + 1 for index, job_id in enumerate(placed)})
    with session_scope(db.sessions) as session:
        pages = [queue_view.queue_page(session, tenant=None, limit=2, offset=offset) for offset in range(0, 7, 2)]
        straddling = queue_view.queue_page(session, tenant=None, limit=3, offset=2)
    assert [_ids(page) for page in pages] == [placed[:2], [placed[2], unplaced[0]], unplaced[1:], []]
    assert _ids(straddling) == [placed[2], *unplaced[:2]]
    assert {page.total for page in (*pages, straddling)} == {6}


def test_a_tenants_slice_keeps_the_positions_of_the_whole_queue(db: Database) -> None:
    a1, b1, a2 = _submit(db, "a-one"), _submit(db, "b-one", tenant="team-b"), _submit(db, "a-two")
    _plan(db, {b1: 1, a2: 2, a1: 3})
    with session_scope(db.sessions) as session:
        page = queue_view.queue_page(session, tenant="team-a", limit=100, offset=0)
    assert [(job.id, job.position) for job in page.items] == [(a2, 2), (a1, 3)] and page.total == 2


def test_each_job_shows_its_size_reason_and_preemptions(db: Database) -> None:
    job_id = _submit(
        db, "sized", workers={"min": 2, "max": 4, "cpus_per_worker": 0.5}, priority=3, train={"global_batch_size": 48}
    )
    _plan(db, {job_id: 1}, {job_id: "no capacity: needs 1 CPU more"})
    with session_scope(db.sessions) as session:
        job = session.get(Job, job_id)
        assert job is not None
        job.preemptions, job.preempted_for = 2, "f" * 32
    with session_scope(db.sessions) as session:
        [shown] = queue_view.queue_page(session, tenant=None, limit=10, offset=0).items
    assert shown.workers == queue_view.WorkerRange(min=2, max=4, cpus_per_worker=0.5, gpus_per_worker=0)
    assert (shown.name, shown.tenant, shown.priority) == ("sized", "team-a", 3)
    assert shown.waiting_reason == "no capacity: needs 1 CPU more"
    assert (shown.preemptions, shown.preempted_for) == (2, "f" * 32)
    assert shown.queued_since.tzinfo is not None


def test_a_stored_spec_missing_worker_fields_reads_with_the_spec_defaults(db: Database) -> None:
    job_id = _submit(db, "old-row")
    with session_scope(db.sessions) as session:
        job = session.get(Job, job_id)
        assert job is not None
        job.spec = {key: value for key, value in job.spec.items() if key != "workers"}
    with session_scope(db.sessions) as session:
        [shown] = queue_view.queue_page(session, tenant=None, limit=10, offset=0).items
    assert shown.workers == queue_view.WorkerRange(min=1, max=1, cpus_per_worker=1.0, gpus_per_worker=0)


def test_standing_takes_each_tenants_newest_sample_and_zeros_before_any(db: Database) -> None:
    with session_scope(db.sessions) as session:
        tenants.put_tenant(session, "team-a", tenants.Quota(gpus=8), weight=3)
        tenants.put_tenant(session, "team-b", tenants.Quota())
        tenants.put_tenant(session, "team-c", tenants.Quota())
        queue_view.record_shares(session, T0, [ShareSample("team-a", 2, 0.0, 0.25, 0.2, 0.75)])
        queue_view.record_shares(
            session,
            T0 + timedelta(seconds=5),
            [ShareSample("team-a", 4, 0.0, 0.5, 0.3, 0.75), ShareSample("team-b", 0, 2.0, 0.1, 0.05, 0.25)],
        )
    with session_scope(db.sessions) as session:
        standing = {row.name: row for row in queue_view.tenant_standing(session)}
        only_b = queue_view.tenant_standing(session, tenant="team-b")
    a = standing["team-a"]
    assert (a.weight, a.quota, a.held_gpus, a.share, a.decayed_share, a.entitled_share) == (
        3.0,
        tenants.Quota(gpus=8),
        4,
        0.5,
        0.3,
        0.75,
    )
    assert a.sampled_at == T0 + timedelta(seconds=5)
    assert standing["team-b"].held_cpus == 2.0 and standing["team-b"].weight == 1.0
    c = standing["team-c"]
    assert (c.share, c.decayed_share, c.entitled_share, c.held_gpus, c.sampled_at) == (0.0, 0.0, 0.0, 0, None)
    assert [row.name for row in only_b] == ["team-b"]


def test_the_share_series_is_per_tenant_oldest_first_and_since_the_time_asked(db: Database) -> None:
    with session_scope(db.sessions) as session:
        for second in range(0, 30, 5):
            at = T0 + timedelta(seconds=second)
            queue_view.record_shares(
                session, at, [ShareSample("team-a", share=second / 100), ShareSample("team-b", share=0.5)]
            )
    with session_scope(db.sessions) as session:
        series = queue_view.share_series(session, T0 + timedelta(seconds=10))
        only_a = queue_view.share_series(session, T0, tenant="team-a")
    assert set(series) == {"team-a", "team-b"}
    assert [point.share for point in series["team-a"]] == [0.1, 0.15, 0.2, 0.25]
    assert [point.at for point in series["team-b"]] == [T0 + timedelta(seconds=s) for s in (10, 15, 20, 25)]
    assert set(only_a) == {"team-a"} and len(only_a["team-a"]) == 6


def test_a_long_series_is_thinned_evenly_and_keeps_the_newest_point(db: Database) -> None:
    with session_scope(db.sessions) as session:
        for second in range(100):
            queue_view.record_shares(session, T0 + timedelta(seconds=second), [ShareSample("team-a", share=second)])
    with session_scope(db.sessions) as session:
        points = queue_view.share_series(session, T0, max_points=10)["team-a"]
    assert len(points) <= 10 and points[-1].share == 99
    gaps = {(later.at - earlier.at).total_seconds() for earlier, later in pairwise(points)}
    assert len(gaps) == 1  # evenly spaced


def test_recording_drops_samples_older_than_the_retention(db: Database) -> None:
    with session_scope(db.sessions) as session:
        queue_view.record_shares(session, T0, [ShareSample("team-a")])
        queue_view.record_shares(session, T0 + timedelta(days=3), [ShareSample("team-a")])
        queue_view.record_shares(session, T0 + timedelta(days=7, seconds=1), [ShareSample("team-a", share=0.5)])
    with session_scope(db.sessions) as session:
        kept = sorted(session.scalars(select(TenantShare.at)))
    assert kept == [T0 + timedelta(days=3), T0 + timedelta(days=7, seconds=1)]
    with session_scope(db.sessions) as session:
        queue_view.record_shares(session, T0 + timedelta(days=8), [], retention=timedelta(hours=1))
    with session_scope(db.sessions) as session:
        assert list(session.scalars(select(TenantShare.at))) == []
