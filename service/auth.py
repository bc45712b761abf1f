"""API tokens: who a bearer token speaks for, and the per-attempt secrets job drivers report with.

Only the SHA-256 of a secret is stored; the secret itself is shown once, when it is made. Secrets are 256
random bits, so a plain hash (not a slow password hash) is enough to make a stolen table useless.

The API looks bearer tokens up through a per-database TokenCache (token_cache): a token that worked is
trusted for TOKEN_CACHE_TTL_S without a query. A revocation committed in this process clears it at once; one
committed elsewhere (another replica, the CLI) takes effect here within TOKEN_CACHE_TTL_S.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from sqlalchemy import Engine, event, select
from sqlalchemy.orm import Session, sessionmaker

from ringmaster.service.db import session_scope
from ringmaster.service.errors import RingmasterError
from ringmaster.service.models import DEFAULT_TENANT, ApiToken, Attempt, utcnow
from ringmaster.service.tenants import ensure_tenant

TOKEN_PREFIX = "rm_"
TOKEN_CACHE_TTL_S = 5.0
"""How long a replica trusts a token it looked up; the bound on a revocation made on another replica."""
_REVOKED = "ringmaster_revoked_tokens"


class Unauthorized(RingmasterError):
    """No usable credentials: missing, malformed, unknown or revoked (HTTP 401)."""


class Forbidden(RingmasterError):
    """Valid credentials that may not do this (HTTP 403): a tenant's token on an admin route."""


class OwnTokenRevocation(RingmasterError):
    """A request asked to revoke the very token it carries."""


class TokenNotFound(RingmasterError):
    def __init__(self, token_id: int) -> None:
        super().__init__(f"no API token with id {token_id}")


@dataclass(frozen=True)
class Principal:
    """The caller behind a token: its tenant, and whether it administers every tenant."""

    tenant: str
    admin: bool
    token_id: int | None = None

    @property
    def scope(self) -> str | None:
        """The only tenant whose jobs this caller may see; None for an admin, who sees all."""
        return None if self.admin else self.tenant


SYSTEM = Principal(DEFAULT_TENANT, admin=True)
"""In-process callers that hold no token (the CLI's database commands, tests)."""


@dataclass(frozen=True)
class IssuedToken:
    row: ApiToken
    secret: str = ""  # shown once; only its hash is stored
    tenant_created: bool = False


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def create_token(session: Session, tenant: str, *, admin: bool = False, description: str | None = None) -> IssuedToken:
    """A new token for the tenant (created without quotas when missing); the secret is in the result only."""
    if description is not None and len(description) > 255:
        raise ValueError("a token's description is at most 255 characters")
    _, created = ensure_tenant(session, tenant)
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(
        token_hash=hash_secret(secret), tenant=tenant, admin=admin, description=description, created_at=utcnow()
    )
    session.add(row)
    session.flush()
    return IssuedToken(row, secret, created)


def list_tokens(session: Session, tenant: str | None = None) -> list[ApiToken]:
    query = select(ApiToken).order_by(ApiToken.id)
    if tenant is not None:
        query = query.where(ApiToken.tenant == tenant)
    return list(session.scalars(query))


def revoke_token(session: Session, token_id: int, by: Principal | None = None) -> ApiToken:
    """Revoke at once (the next request with it is refused); revoking again keeps the first time. A request may not
    revoke the token it was made with (by): its holder, perhaps the last admin, would be locked out."""
    row = session.get(ApiToken, token_id, with_for_update=True) if 0 < token_id < 2**31 else None
    if row is None:
        raise TokenNotFound(token_id)
    if by is not None and by.token_id == token_id:
        raise OwnTokenRevocation(
            f"token {token_id} is the one this request was made with: revoke it with another admin's "
            "token (or `ringmaster token revoke` on the database)"
        )
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.flush()
        session.info.setdefault(_REVOKED, set()).add(row.id)  # dropped from this process's caches once committed
    return row


def authenticate(session: Session, secret: str) -> Principal:
    """The principal a bearer secret speaks for; Unauthorized for an unknown or revoked one."""
    return _authenticate_hash(session, hash_secret(secret))


def _authenticate_hash(session: Session, token_hash: str) -> Principal:
    row = session.scalars(select(ApiToken).where(ApiToken.token_hash == token_hash)).first()
    if row is None:
        raise Unauthorized("invalid API token")
    if row.revoked_at is not None:
        raise Unauthorized(f"API token {row.id} was revoked at {row.revoked_at:%Y-%m-%d %H:%M:%S} UTC")
    return Principal(row.tenant, row.admin, row.id)


class TokenCache:
    """Token hash -> principal for ttl_s after a successful lookup; unknown and revoked tokens are never cached."""

    def __init__(
        self, ttl_s: float = TOKEN_CACHE_TTL_S, max_entries: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`clock`: seconds from any fixed point (tests pass their own, to expire entries without waiting)."""
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: dict[str, tuple[Principal, float]] = {}
        self._generation = 0  # bumped by every revocation: a lookup that raced one does not cache what it read
        self._lock = threading.Lock()

    def get(self, secret: str) -> Principal | None:
        """The principal cached for secret while it is fresh; None means ask load()."""
        cached = self._entries.get(hash_secret(secret))
        return cached[0] if cached is not None and cached[1] > self._clock() else None

    def load(self, sessions: sessionmaker[Session], secret: str) -> Principal:
        """The principal from the database (a short transaction of its own), cached when the token is valid."""
        token_hash = hash_secret(secret)
        started = self._clock()
        generation = self._generation
        with session_scope(sessions) as session:
            principal = _authenticate_hash(session, token_hash)
        with self._lock:
            if generation == self._generation:
                if len(self._entries) >= self.max_entries:
                    self._entries = {key: entry for key, entry in self._entries.items() if entry[1] > started}
                self._entries[token_hash] = (principal, started + self.ttl_s)
        return principal

    def forget(self, token_ids: Iterable[int]) -> None:
        """Drop these tokens now, and keep lookups that were already in flight from caching them again."""
        revoked = set(token_ids)
        with self._lock:
            self._generation += 1
            self._entries = {key: entry for key, entry in self._entries.items() if entry[0].token_id not in revoked}


_caches: weakref.WeakKeyDictionary[Engine, TokenCache] = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def token_cache(sessions: sessionmaker[Session]) -> TokenCache:
    """The token cache of the sessions' database: one per engine in this process, which revocations here clear."""
    engine = sessions.kw["bind"]
    if not isinstance(engine, Engine):
        raise TypeError(f"a token cache needs a sessionmaker bound to an Engine, not {type(engine).__name__}")
    with _caches_lock:
        cache = _caches.get(engine)
        if cache is None:
            cache = _caches[engine] = TokenCache()
        return cache


@event.listens_for(Session, "after_commit")
def _forget_revoked(session: Session) -> None:
    revoked = session.info.pop(_REVOKED, None)
    if revoked and isinstance(session.bind, Engine):
        with _caches_lock:
            cache = _caches.get(session.bind)
        if cache is not None:
            cache.forget(revoked)


@event.listens_for(Session, "after_rollback")
def _keep_unrevoked(session: Session) -> None:
    session.info.pop(_REVOKED, None)


def require_admin(principal: Principal) -> None:
    if not principal.admin:
        raise Forbidden(f"this needs an admin token; the token of tenant {principal.tenant!r} is not one")


def new_report_token() -> tuple[str, str]:
    """A fresh secret for one attempt's driver and the hash to store on the attempt."""
    secret = secrets.token_urlsafe(32)
    return secret, hash_secret(secret)


def check_report_token(session: Session, job_id: str, attempt: int, secret: str | None) -> None:
    """Unauthorized unless secret is the one minted for this very attempt of this job."""
    if not secret:
        raise Unauthorized("missing report token: the job driver sends its attempt's secret as a bearer token")
    row = None
    if len(job_id) <= 32 and 0 < attempt < 2**31:
        row = session.scalars(select(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt)).first()
    if (
        row is None
        or row.report_token_hash is None
        or not hmac.compare_digest(row.report_token_hash, hash_secret(secret))
    ):
        raise Unauthorized(f"this report token does not belong to attempt {attempt} of job {job_id[:32]!r}")


class CheckedReportTokens:
    """The report tokens this process has found good, by (job id, attempt, the secret's hash). An attempt's secret is
    minted with the attempt and never changes, so a driver reporting every second is looked up once, not at every
    report; a wrong secret is never remembered."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self.max_entries = max_entries
        self._good: set[tuple[str, int, str]] = set()
        self._lock = threading.Lock()

    def known(self, job_id: str, attempt: int, secret: str | None) -> bool:
        if not secret:
            return False
        return (job_id, attempt, hash_secret(secret)) in self._good

    def check(self, sessions: sessionmaker[Session], job_id: str, attempt: int, secret: str | None) -> None:
        """check_report_token in a short transaction of its own; remembered when good."""
        with session_scope(sessions) as session:
            check_report_token(session, job_id, attempt, secret)
        with self._lock:
            if len(self._good) >= self.max_entries:
                self._good.clear()  # attempts end; whichever still report are looked up again once
            # Never None here: check_report_token refused a missing secret.
            self._good.add((job_id, attempt, hash_secret(cast(str, secret))))


def ensure_local_admin_token(sessions: sessionmaker[Session], path: Path) -> str:
    """The admin token in path, minted and written (mode 0600) unless the file holds one that still works."""
    existing = _read(path)
    if existing:
        with session_scope(sessions) as session:
            try:
                if authenticate(session, existing).admin:
                    return existing
            except Unauthorized:
                pass
    with session_scope(sessions) as session:
        issued = create_token(session, DEFAULT_TENANT, admin=True, description=f"local admin token in {path}")
    _write_private(path, issued.secret + "\n")
    return issued.secret


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def _write_private(path: Path, text: str) -> None:
    """Replace path atomically with a file only its owner can read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(descriptor, text.encode())
    finally:
        os.close(descriptor)
    os.chmod(partial, 0o600)
    os.replace(partial, path)
