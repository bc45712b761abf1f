"""User-facing job routes: parse, call service.jobs, convert to a schema."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, HTTPException, Query, Request, status
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from ringmaster.api.deps import CurrentPrincipal, DatabaseDep, SessionDep, SettingsDep, read_cluster_shape
from ringmaster.api.errors import FiniteJSONResponse, JSONModelResponse, error_responses, finite_values
from ringmaster.api.limits import check_document, load_json, load_yaml
from ringmaster.api.schemas import CheckpointOut, EventOut, JobDetailOut, JobOut, MetricsPage, Page
from ringmaster.service import jobs
from ringmaster.service.db import Database, session_scope
from ringmaster.service.errors import InvalidSpec, JobConflict, LogsUnavailable
from ringmaster.service.event_stream import Cursor, read_batch
from ringmaster.service.spec import JobSpec, field_meant
from ringmaster.service.states import JobState

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=error_responses(401, 404))

YAML_TYPES = frozenset({"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"})
ListLimit = Annotated[int, Query(ge=1, le=10_000)]
Offset = Annotated[int, Query(ge=0, le=2**31 - 1)]


def _errors(exc: ValidationError) -> list[dict[str, Any]]:
    # The context stays: a rule between fields carries the field it names there (api.errors.readable_errors).
    errors: list[dict[str, Any]] = [dict(error) for error in exc.errors(include_url=False)]
    for error in errors:
        if error["type"] == "extra_forbidden" and (meant := field_meant(JobSpec, tuple(error["loc"]))) is not None:
            error["msg"] = f"{error['msg']}: did you mean {meant!r}?"
    return errors


async def spec_from_body(request: Request) -> JobSpec:
    """The JobSpec from a JSON or YAML body (FastAPI's own body parsing only speaks JSON), within api.limits' bounds."""
    media_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media_type in YAML_TYPES:
        document = load_yaml(await request.body())
    elif media_type == "application/json" or media_type.endswith("+json"):
        document = load_json(await request.body())
    else:
        raise HTTPException(
            status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
            f"send the job spec as application/json or application/yaml, not {media_type!r}",
        )
    if not isinstance(document, dict):
        raise InvalidSpec([{"type": "model_type", "loc": [], "msg": "a job spec must be a mapping of fields"}])
    check_document(document)
    try:
        return JobSpec.model_validate(document)
    except ValidationError as exc:
        raise InvalidSpec(_errors(exc)) from exc


_SPEC_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}},
            # OpenAPI reads a YAML body's schema as that of the data it holds: the same JobSpec.
            "application/yaml": {"schema": {"$ref": "#/components/schemas/JobSpec"}},
        },
    },
    # FastAPI documents its 422 only for the bodies it parses itself.
    "responses": {
        "422": {
            "description": "Validation Error",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}},
        }
    },
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobDetailOut,
    openapi_extra=_SPEC_BODY,
    responses=error_responses(413, 415),
)
def submit(
    request: Request, principal: CurrentPrincipal, spec: Annotated[JobSpec, Depends(spec_from_body)]
) -> FiniteJSONResponse:
    """Queue a job for the caller's tenant; 422 when the spec is invalid or larger than the tenant's quota allows."""
    # The database, settings and cluster shape come from app.state here, not as dependencies: FastAPI resolves each
    # dependency anew on every request, and this is the route clients call most.
    state = request.app.state
    cluster = read_cluster_shape(request)  # before the transaction opens: a provider may ask Ray, which is slow
    with session_scope(state.db.sessions) as session:
        job = jobs.submit_job(session, spec, cluster, principal)
        created = JobDetailOut.from_job(job, state.settings, [], jobs.Progress.not_started(spec.train.steps))
    _wake_dispatcher(request)
    # Rendered here, in this worker thread: a returned model costs FastAPI a second trip through the thread pool.
    return FiniteJSONResponse(created.model_dump(mode="json"), status_code=status.HTTP_201_CREATED)


@router.get("", response_model=Page[JobOut])
def list_jobs(
    principal: CurrentPrincipal,
    session: SessionDep,
    settings: SettingsDep,
    state: JobState | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Offset = 0,
    id_prefix: Annotated[
        str | None,
        Query(
            pattern="^[0-9a-f]{1,32}$",
            description="Only jobs whose id starts with this (how the CLI takes an unambiguous short id).",
        ),
    ] = None,
) -> JSONModelResponse:
    """The caller's tenant's jobs, newest first; an admin's token lists every tenant's."""
    page = jobs.list_jobs(session, state, limit, offset, tenant=principal.scope, id_prefix=id_prefix)
    # Serialized here, straight to JSON by pydantic (NaN and infinities as null, as FiniteJSONResponse writes them): a
    # returned model would be dumped, validated again and encoded by FastAPI, a fifth of a 200-job page's time (each
    # job carries its whole spec).
    return JSONModelResponse(Page[JobOut].convert(page, lambda job: JobOut.from_row(job, settings)))


@router.get("/{job_id}")
def get_job(job_id: str, principal: CurrentPrincipal, session: SessionDep, settings: SettingsDep) -> JobDetailOut:
    job = jobs.get_job(session, job_id, principal.scope)
    return JobDetailOut.from_job(job, settings, jobs.list_memory(session, job_id), jobs.job_progress(session, job))


@router.post("/{job_id}/cancel", responses=error_responses(409))
def cancel(
    request: Request, job_id: str, principal: CurrentPrincipal, db: DatabaseDep, settings: SettingsDep
) -> JobDetailOut:
    with session_scope(db.sessions) as session:
        job = jobs.cancel_job(session, job_id, principal.scope)
        cancelled = JobDetailOut.from_job(
            job, settings, jobs.list_memory(session, job_id), jobs.job_progress(session, job)
        )
    _wake_dispatcher(request)  # after the commit, so it sees the cancellation and stops the Ray job now
    return cancelled


def _wake_dispatcher(request: Request) -> None:
    """An in-process dispatcher acts on a new or cancelled job now rather than at its next pass."""
    wake = getattr(request.app.state, "wake_dispatcher", None)
    if wake is not None:
        wake()


@router.get("/{job_id}/events")
def events(
    job_id: str, principal: CurrentPrincipal, session: SessionDep, limit: ListLimit = 1000, offset: Offset = 0
) -> Page[EventOut]:
    return Page[EventOut].convert(
        jobs.list_events(session, job_id, limit, offset, principal.scope), EventOut.model_validate
    )


@router.get("/{job_id}/metrics")
def metrics(
    job_id: str, principal: CurrentPrincipal, session: SessionDep, limit: ListLimit = 1000, offset: Offset = 0
) -> MetricsPage:
    """Metric rows by attempt and step; ``memory`` (not paged) holds each rank's state memory, measured and
    predicted."""
    page = jobs.list_metrics(session, job_id, limit, offset, principal.scope)
    return MetricsPage.build(page, jobs.list_memory(session, job_id))


@router.get("/{job_id}/checkpoints")
def checkpoints(
    job_id: str, principal: CurrentPrincipal, session: SessionDep, limit: ListLimit = 1000, offset: Offset = 0
) -> Page[CheckpointOut]:
    page = jobs.list_checkpoints(session, job_id, limit, offset, principal.scope)
    return Page[CheckpointOut].convert(page, CheckpointOut.model_validate)


_LOGS_DOC = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **error_responses(409, 503)}


# No response_class=PlainTextResponse: FastAPI would then document the JSON errors as text/plain.
@router.get("/{job_id}/logs", responses=_LOGS_DOC)
def logs(job_id: str, principal: CurrentPrincipal, request: Request, db: DatabaseDep) -> PlainTextResponse:
    """The current attempt's driver log; the transaction ends before the (slow) provider is called."""
    provider = request.app.state.logs_provider
    with session_scope(db.sessions) as session:
        submission_id = jobs.get_job(session, job_id, principal.scope).submission_id
    if provider is None:
        raise LogsUnavailable(
            "this server has no logs provider configured; job logs are served when it runs with a Ray cluster"
        )
    if submission_id is None:
        raise JobConflict(f"job {job_id} has not been dispatched to Ray yet, so it has no logs")
    return PlainTextResponse(provider(submission_id))


_KEEPALIVE_S = 15.0
_SSE_EVENT = {
    "type": "object",
    "required": ["id", "event", "data"],
    "properties": {
        "id": {"type": "string", "description": "Resume after this event with Last-Event-ID."},
        "event": {"type": "string", "enum": ["state", "event", "metric"]},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "description": "state: the transition; event: an EventOut; metric: a MetricOut.",
        },
    },
}
_STREAM_DOC = {
    "responses": {
        200: {
            "description": "Server-sent events: `state`, `event` and `metric`, each with a JSON `data` "
            "line and an `id` to resume from with Last-Event-ID.",
            "content": {"text/event-stream": {"schema": _SSE_EVENT}},
        }
    }
}


@router.get("/{job_id}/stream", response_class=StreamingResponse, openapi_extra=_STREAM_DOC)
async def stream(job_id: str, principal: CurrentPrincipal, request: Request, db: DatabaseDep) -> StreamingResponse:
    """State changes, events and metric rows as they are written; ends once the job is terminal and all was sent.

    The database is polled (no session is held between polls), so it works across replicas; reconnect with the
    Last-Event-ID header to resume after the last event received.
    """
    cursor = _cursor(request.headers.get("last-event-id"))
    await run_in_threadpool(_check_exists, db, job_id, principal.scope)  # 404 before the 200 and the stream start
    poll_s: float = request.app.state.stream_poll_s
    return StreamingResponse(
        _events(request, db, job_id, cursor, poll_s),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _cursor(last_event_id: str | None) -> Cursor:
    """The client's Last-Event-ID; one with numbers no database column holds starts from the beginning."""
    cursor = Cursor.parse(last_event_id)
    if not all(-1 <= part < 2**31 for part in (cursor.event_id, cursor.attempt, cursor.step)):
        return Cursor()
    return cursor


def _check_exists(db: Database, job_id: str, tenant: str | None) -> None:
    with session_scope(db.sessions) as session:
        jobs.get_job(session, job_id, tenant)


async def _events(request: Request, db: Database, job_id: str, cursor: Cursor, poll_s: float) -> AsyncIterator[str]:
    def read(after: Cursor) -> Any:
        with session_scope(db.sessions) as session:
            return read_batch(session, job_id, after)

    last_sent = time.monotonic()
    while True:
        batch = await run_in_threadpool(read, cursor)
        for item in batch.items:
            data = json.dumps(finite_values(item.data), separators=(",", ":"), allow_nan=False)
            yield f"id: {item.cursor}\nevent: {item.type}\ndata: {data}\n\n"
        cursor = batch.cursor
        if batch.items:
            last_sent = time.monotonic()
        if batch.finished:
            return
        if batch.more:
            continue
        if time.monotonic() - last_sent >= _KEEPALIVE_S:
            yield ": keepalive\n\n"
            last_sent = time.monotonic()
        if await request.is_disconnected():
            return
        await anyio.sleep(poll_s)
