"""The job queue: dispatchers claim QUEUED jobs with a lease so that no job is dispatched twice.

A claim is one short transaction. On PostgreSQL, ``SELECT … FOR UPDATE SKIP LOCKED`` lets
concurrent claimers pass over each other's rows instead of queueing behind them (and a row
committed by another claimer meanwhile is re-checked against the lease condition). SQLite has no
row locks: the engine opens every transaction with ``BEGIN IMMEDIATE`` (service/db.py), so
claims are serialized by the database write lock and the second claimer sees the first's lease.
"""

from __future__ import annotations

from collections.abc import Set
from datetime import timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from ringmaster.service.db import session_scope
from ringmaster.service.models import Job, utcnow
from ringmaster.service.states import JobState


def claim_next(
    sessions: sessionmaker[Session], owner: str, lease_s: float, skip_ids: Set[str] = frozenset()
) -> Job | None:
    """Lease the highest-priority, then oldest, QUEUED job nobody holds; None when there is none."""
    with session_scope(sessions) as session:
        now = utcnow()
        query = (
            select(Job)
            .where(Job.state == JobState.QUEUED, or_(Job.lease_expires_at.is_(None), Job.lease_expires_at <= now))
            .order_by(Job.priority.desc(), Job.created_at, Job.id)
            .limit(1)
            .with_for_update(skip_locked=True)
        )
        if skip_ids:
            query = query.where(Job.id.not_in(skip_ids))
        job = session.scalars(query).first()
        if job is None:
            return None
        job.lease_owner = owner
        job.lease_expires_at = now + timedelta(seconds=lease_s)
    return job


def claim(sessions: sessionmaker[Session], job_id: str, owner: str, lease_s: float) -> Job | None:
    """Lease this QUEUED job, which a plan admits; None when it is no longer queued or another dispatcher holds it."""
    with session_scope(sessions) as session:
        now = utcnow()
        job = session.scalars(
            select(Job)
            .where(
                Job.id == job_id,
                Job.state == JobState.QUEUED,
                or_(Job.lease_expires_at.is_(None), Job.lease_expires_at <= now),
            )
            .with_for_update(skip_locked=True)
        ).first()
        if job is None:
            return None
        job.lease_owner = owner
        job.lease_expires_at = now + timedelta(seconds=lease_s)
    return job


def release(sessions: sessionmaker[Session], job_id: str, owner: str, waiting_reason: str | None = None) -> bool:
    """Give a claimed job back at once; False when owner no longer holds it.

    waiting_reason says why it stays queued (over its tenant's quota, no room on the cluster yet), for GET
    /v1/jobs/{id}.
    """
    with session_scope(sessions) as session:
        job = session.get(Job, job_id, with_for_update=True)
        if job is None or job.lease_owner != owner:
            return False
        job.lease_owner = job.lease_expires_at = None
        if job.state == JobState.QUEUED and job.waiting_reason != waiting_reason:
            job.waiting_reason = waiting_reason
        return True
