"""A job's code: a zip archive uploaded once per content, named by its SHA-256 in the JobSpec's ``code``."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response, status
from starlette.concurrency import run_in_threadpool

from ringmaster.api.deps import CurrentPrincipal, SessionDep
from ringmaster.api.errors import error_responses
from ringmaster.api.schemas import CodeArchiveOut
from ringmaster.service import code_store
from ringmaster.service.db import session_scope

UPLOAD_PATH = "/v1/code"
ARCHIVE_TYPES = frozenset({"application/zip", "application/x-zip-compressed", "application/octet-stream"})

router = APIRouter(prefix=UPLOAD_PATH, tags=["code"], responses=error_responses(401))

_ARCHIVE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/zip": {"schema": {"type": "string", "format": "binary"}}},
    },
    "responses": {
        "422": {
            "description": "Not a zip, an unsafe path inside, or nothing in it",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}},
        }
    },
}


@router.post(
    "",
    response_model=CodeArchiveOut,
    status_code=status.HTTP_201_CREATED,
    openapi_extra=_ARCHIVE_BODY,
    responses={
        200: {"model": CodeArchiveOut, "description": "The tenant had this archive already"},
        **error_responses(413, 415),
    },
)
async def upload(request: Request, response: Response, principal: CurrentPrincipal) -> CodeArchiveOut:
    """Store a zip of a job's code for the caller's tenant: 201 when new, 200 when the tenant has it already (same
    hash).

    Larger than RINGMASTER_MAX_CODE_BYTES, packed or unpacked: 413, and nothing is stored."""
    media_type = request.headers.get("content-type", "application/octet-stream").split(";")[0].strip().lower()
    if media_type not in ARCHIVE_TYPES:
        raise HTTPException(
            status.HTTP_415_UNSUPPORTED_MEDIA_TYPE, f"send the code archive as application/zip, not {media_type!r}"
        )
    content = await request.body()  # bounded by api.limits.BodySizeLimit at RINGMASTER_MAX_CODE_BYTES
    state = request.app.state

    def store() -> tuple[CodeArchiveOut, bool]:
        with session_scope(state.db.sessions) as session:
            row, created = code_store.store_archive(session, principal.tenant, content, state.settings.max_code_bytes)
            return CodeArchiveOut.from_row(row), created

    stored, created = await run_in_threadpool(store)
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return stored


@router.get("/{code}", responses=error_responses(404))
def describe(code: str, principal: CurrentPrincipal, session: SessionDep) -> CodeArchiveOut:
    """The caller's tenant's archive of this 'sha256:<hex>'; 404 when it has none (whoever else may)."""
    return CodeArchiveOut.from_row(code_store.find_archive(session, principal.tenant, code))
