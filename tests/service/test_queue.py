"""The queue hands each QUEUED job to one dispatcher at a time, best first, and takes it back when a lease lapses."""

from __future__ import annotations

import threading
from datetime import timedelta

from ringmaster.service.db import Database, session_scope
from ringmaster.service.jobs import cancel_job, submit_job
from ringmaster.service.models import Job, utcnow
from ringmaster.service.queue import claim_next, release
from ringmaster.service.spec import JobSpec


def _submit(db: Database, name: str, priority: int = 0, age_s: float = 0.0) -> str:
    """Submit a job that looks age_s old, so ordering by age does not depend on the clock's resolution."""
    with session_scope(db.sessions) as session:
        job = submit_job(session, JobSpec(name=name, model="mlp", priority=priority))
        job.created_at = utcnow() - timedelta(seconds=age_s)
        return job.id


def _lease(db: Database, job_id: str) -> tuple[str | None, object]:
    with session_scope(db.sessions) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job.lease_owner, job.lease_expires_at


def test_claims_highest_priority_first_then_oldest(db: Database) -> None:
    low = _submit(db, "low", priority=-5, age_s=100)
    young = _submit(db, "young", priority=5, age_s=1)
    old = _submit(db, "old", priority=5, age_s=50)
    middle = _submit(db, "middle", priority=0, age_s=10)
    claimed = [claim_next(db.sessions, "d1", lease_s=30) for _ in range(5)]
    assert [job.id if job else None for job in claimed] == [old, young, middle, low, None]


def test_claim_sets_a_lease_that_keeps_other_claimers_away(db: Database) -> None:
    job_id = _submit(db, "one")
    before = utcnow()
    job = claim_next(db.sessions, "d1", lease_s=30)
    assert job is not None and job.id == job_id
    owner, expires = _lease(db, job_id)
    assert owner == "d1"
    assert before + timedelta(seconds=29) < expires < utcnow() + timedelta(seconds=31)  # type: ignore[operator]
    assert claim_next(db.sessions, "d2", lease_s=30) is None


def test_expired_lease_makes_the_job_claimable_again(db: Database) -> None:
    job_id = _submit(db, "one")
    assert claim_next(db.sessions, "dead", lease_s=30) is not None
    with session_scope(db.sessions) as session:
        job = session.get(Job, job_id)
        assert job is not None
        job.lease_expires_at = utcnow() - timedelta(seconds=1)
    taken = claim_next(db.sessions, "alive", lease_s=30)
    assert taken is not None and taken.id == job_id and taken.lease_owner == "alive"


def test_release_frees_the_job_only_for_its_owner(db: Database) -> None:
    job_id = _submit(db, "one")
    assert claim_next(db.sessions, "d1", lease_s=30) is not None
    assert release(db.sessions, job_id, "d2") is False
    assert claim_next(db.sessions, "d2", lease_s=30) is None
    assert release(db.sessions, job_id, "d1") is True
    assert _lease(db, job_id) == (None, None)
    taken = claim_next(db.sessions, "d2", lease_s=30)
    assert taken is not None and taken.id == job_id


def test_skip_ids_and_non_queued_jobs_are_passed_over(db: Database) -> None:
    skipped = _submit(db, "skipped", priority=9)
    cancelled = _submit(db, "cancelled", priority=8)
    wanted = _submit(db, "wanted", priority=0)
    with session_scope(db.sessions) as session:
        cancel_job(session, cancelled)
    taken = claim_next(db.sessions, "d1", lease_s=30, skip_ids={skipped})
    assert taken is not None and taken.id == wanted
    assert claim_next(db.sessions, "d1", lease_s=30, skip_ids={skipped}) is None


def test_concurrent_claimers_never_get_the_same_job(db: Database) -> None:
    with session_scope(db.sessions) as session:
        expected = {submit_job(session, JobSpec(name=f"job-{i}", model="mlp", priority=i % 3)).id for i in range(40)}
    claimers = 4
    start = threading.Barrier(claimers)
    claims: dict[str, list[str]] = {f"d{i}": [] for i in range(claimers)}
    failures: list[BaseException] = []

    def claim_all(owner: str) -> None:
        try:
            start.wait()
            while (job := claim_next(db.sessions, owner, lease_s=60)) is not None:
                claims[owner].append(job.id)
        except BaseException as exc:  # surfaced below: a thread's exception would otherwise vanish
            failures.append(exc)

    threads = [threading.Thread(target=claim_all, args=(owner,)) for owner in claims]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not failures
    everything = [job_id for owned in claims.values() for job_id in owned]
    assert len(everything) == len(set(everything)), "a job was claimed twice"
    assert set(everything) == expected
    for owner, owned in claims.items():
        assert all(_lease(db, job_id)[0] == owner for job_id in owned)
