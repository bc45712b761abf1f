"""A job's code in the database: zip archives uploaded by tenants, content-addressed by SHA-256.

An upload is checked before it is stored (a zip, every path relative and inside it, within RINGMASTER_MAX_CODE_BYTES
packed and unpacked) and stored in one INSERT, so a refused upload leaves nothing behind; the same archive uploaded
again is the same row. The dispatcher copies an archive to a local file that it hands Ray as the job's working_dir:
Ray uploads it as a package of its own and every node unpacks it from there.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, undefer

from ringmaster.service.errors import CodeNotFound, CodeTooLarge, InvalidCode
from ringmaster.service.models import CodeArchive, utcnow
from ringmaster.service.spec import CODE_REF

REF_PREFIX = "sha256:"
MAX_FILES = 100_000


def ref_of(sha256: str) -> str:
    return f"{REF_PREFIX}{sha256}"


def _sha256_of(ref: str) -> str | None:
    return ref.removeprefix(REF_PREFIX) if CODE_REF.match(ref) else None


def check_archive(content: bytes, max_bytes: int) -> tuple[int, int]:
    """(files, unpacked bytes) of a zip the cluster can unpack safely; CodeTooLarge or InvalidCode otherwise."""
    if len(content) > max_bytes:
        raise CodeTooLarge("the code archive", len(content), max_bytes)
    try:
        archive = zipfile.ZipFile(io.BytesIO(content))
    except zipfile.BadZipFile:
        raise InvalidCode("the body is not a zip archive (send the packed directory as application/zip)") from None
    with archive:
        entries = [entry for entry in archive.infolist() if not entry.is_dir()]
        if not entries:
            raise InvalidCode("the code archive holds no files")
        if len(entries) > MAX_FILES:
            raise InvalidCode(f"the code archive holds {len(entries)} files; at most {MAX_FILES}")
        for entry in entries:
            path = PurePosixPath(entry.filename)
            if path.is_absolute() or ".." in path.parts or "\\" in entry.filename or ":" in path.parts[0]:
                raise InvalidCode(
                    f"the code archive holds {entry.filename[:200]!r}: every path must be relative and stay inside it"
                )
        unpacked = sum(entry.file_size for entry in entries)
        if unpacked > max_bytes:
            raise CodeTooLarge("the code archive unpacked", unpacked, max_bytes)
        try:
            broken = archive.testzip()  # reads every member: what Ray cannot unpack is refused now, not on a node later
        except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as error:
            raise InvalidCode(f"the code archive cannot be read: {error}") from None
        if broken is not None:
            raise InvalidCode(f"the code archive is damaged: {broken[:200]!r} fails its checksum")
    return len(entries), unpacked


def store_archive(session: Session, tenant: str, content: bytes, max_bytes: int) -> tuple[CodeArchive, bool]:
    """The tenant's archive of this content, stored if new: (row, whether this call stored it)."""
    files, unpacked = check_archive(content, max_bytes)
    sha256 = hashlib.sha256(content).hexdigest()
    existing = session.get(CodeArchive, (tenant, sha256))
    if existing is not None:
        return existing, False
    row = CodeArchive(
        tenant=tenant,
        sha256=sha256,
        size_bytes=len(content),
        unpacked_bytes=unpacked,
        files=files,
        created_at=utcnow(),
        content=content,
    )
    try:
        with session.begin_nested():  # another replica may store the same archive at the same moment
            session.add(row)
    except IntegrityError:
        return session.get(CodeArchive, (tenant, sha256), populate_existing=True), False  # type: ignore[return-value]
    return row, True


def find_archive(session: Session, tenant: str, ref: str) -> CodeArchive:
    """The tenant's archive named by 'sha256:<hex>'; CodeNotFound when it has none (another tenant's included)."""
    sha256 = _sha256_of(ref)
    row = session.get(CodeArchive, (tenant, sha256)) if sha256 else None
    if row is None:
        raise CodeNotFound(ref, tenant)
    return row


def has_archive(session: Session, tenant: str, ref: str) -> bool:
    sha256 = _sha256_of(ref)
    return (
        sha256 is not None
        and session.scalar(select(CodeArchive.sha256).where(CodeArchive.tenant == tenant, CodeArchive.sha256 == sha256))
        is not None
    )


def local_copy(session: Session, tenant: str, ref: str, cache_dir: Path) -> Path:
    """A local zip file of the tenant's archive, written once per hash (atomically, checked against its hash)."""
    sha256 = _sha256_of(ref)
    if sha256 is None:
        raise CodeNotFound(ref, tenant)
    path = cache_dir / f"{sha256}.zip"
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == sha256:
        return path
    row = session.scalars(
        select(CodeArchive)
        .options(undefer(CodeArchive.content))
        .where(CodeArchive.tenant == tenant, CodeArchive.sha256 == sha256)
    ).one_or_none()
    if row is None:
        raise CodeNotFound(ref, tenant)
    cache_dir.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=cache_dir, prefix=f".{sha256}.", suffix=".part")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(row.content)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path
