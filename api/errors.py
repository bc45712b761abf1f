"""The one mapping from domain exceptions to HTTP responses.

422 bodies keep FastAPI's shape (``{"detail": [{"type", "loc", "msg", "input"}]}``) and add ``field``: the dotted
path of the value at fault inside the body, query or path, or the part's own name ("body") when the part as a whole
is (not JSON, not a zip). Pydantic's "Value error, " prefix is dropped so JobSpec's own messages read as written.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sqlalchemy.exc import DataError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Mount

from ringmaster.service.auth import Forbidden, OwnTokenRevocation, TokenNotFound, Unauthorized
from ringmaster.service.errors import (
    ClusterUnavailable,
    CodeNotFound,
    CodeTooLarge,
    DrainRefused,
    InvalidCode,
    InvalidSpec,
    JobConflict,
    JobNotFound,
    LogsUnavailable,
    NodeNotFound,
    PlanError,
)
from ringmaster.service.states import IllegalTransition
from ringmaster.service.tenants import InvalidTenant, TenantNotFound

log = logging.getLogger(__name__)

_SOURCES = ("body", "query", "path", "header", "cookie")
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
_PREFIXES = ("Value error, ", "Assertion failed, ")


class FiniteJSONResponse(JSONResponse):
    """JSON with NaN and infinities as null: JSON has no such numbers, yet a diverged loss or an echoed input holds
    them."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except ValueError:  # "Out of range float values are not JSON compliant"
            return json.dumps(
                finite_values(content), ensure_ascii=False, allow_nan=False, separators=(",", ":")
            ).encode("utf-8")


class JSONModelResponse(Response):
    """A pydantic model serialized by pydantic itself, NaN and infinities as null (FiniteJSONResponse's JSON): for a
    route whose answer is large, which FastAPI would dump, validate again against the response model and encode."""

    media_type = "application/json"

    def __init__(self, model: BaseModel, status_code: int = 200) -> None:
        super().__init__(model.model_dump_json(), status_code=status_code)


def finite_values(value: Any) -> Any:
    """The value with every NaN or infinite float replaced by None, as JSON can carry it."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_values(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_values(item) for item in value]
    return value


class ErrorOut(BaseModel):
    detail: str


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the plain {"detail": message} errors a route may answer."""
    return {code: {"model": ErrorOut} for code in codes}


def readable_errors(errors: Iterable[Any], prefix: Sequence[str | int] = ()) -> list[dict[str, Any]]:
    """Pydantic/FastAPI error entries as clients should see them: loc, field path, clean message, input."""
    readable = []
    for error in errors:
        loc = [*prefix, *error.get("loc", ())]
        # A rule between fields (service.spec.conflict) names the field it faults, below the model it validated.
        named = (error.get("ctx") or {}).get("field")
        if isinstance(named, str) and named:
            loc.extend(named.split("."))
        path = loc[1:] if loc and loc[0] in _SOURCES else loc
        message = str(error["msg"])
        for noise in _PREFIXES:
            message = message.removeprefix(noise)
        field = ".".join(map(str, path)) or (str(loc[0]) if loc else "body")
        entry = {"type": error["type"], "loc": loc, "field": field, "msg": message}
        if "input" in error:
            entry["input"] = error["input"]
        readable.append(entry)
    encoded: list[dict[str, Any]] = jsonable_encoder(readable)
    return encoded


def _detail(status_code: int, exc: Exception) -> FiniteJSONResponse:
    return FiniteJSONResponse(status_code=status_code, content={"detail": str(exc)})


async def _not_found(_request: Request, exc: Exception) -> FiniteJSONResponse:
    return _detail(status.HTTP_404_NOT_FOUND, exc)


async def _conflict(_request: Request, exc: Exception) -> FiniteJSONResponse:
    return _detail(status.HTTP_409_CONFLICT, exc)


async def _unauthorized(_request: Request, exc: Exception) -> FiniteJSONResponse:
    return FiniteJSONResponse(
        status_code=status.HTTP_401_UNAUTHORIZED,
        content={"detail": str(exc)},
        headers={"WWW-Authenticate": 'Bearer realm="ringmaster"'},
    )


async def _forbidden(_request: Request, exc: Exception) -> FiniteJSONResponse:
    return _detail(status.HTTP_403_FORBIDDEN, exc)


async def _invalid_tenant(_request: Request, exc: Exception) -> FiniteJSONResponse:
    assert isinstance(exc, InvalidTenant)
    return FiniteJSONResponse(
        status_code=422,
        content={"detail": [{"type": "tenant_invalid", "loc": [exc.field], "field": exc.field, "msg": str(exc)}]},
    )


async def _data_error(_request: Request, exc: Exception) -> FiniteJSONResponse:
    """A value the database refused (out of its column's range, a NUL in text): the input's fault, not the server's."""
    assert isinstance(exc, DataError)
    reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else "value rejected"
    error = {
        "type": "database_value",
        "loc": ["body"],
        "field": "body",
        "msg": f"a value does not fit the database: {reason}",
    }
    return FiniteJSONResponse(status_code=422, content={"detail": [error]})


async def _too_large(_request: Request, exc: Exception) -> FiniteJSONResponse:
    return _detail(status.HTTP_413_CONTENT_TOO_LARGE, exc)


async def _invalid_code(_request: Request, exc: Exception) -> FiniteJSONResponse:
    return FiniteJSONResponse(
        status_code=422,
        content={"detail": [{"type": "code_invalid", "loc": ["body"], "field": "body", "msg": str(exc)}]},
    )


async def _unavailable(_request: Request, exc: Exception) -> FiniteJSONResponse:
    return _detail(status.HTTP_503_SERVICE_UNAVAILABLE, exc)


async def _database_unavailable(request: Request, exc: Exception) -> FiniteJSONResponse:
    """The database went away (restarting, failing over, locked): the client should retry, and the log needs one
    line."""
    log.warning(
        "database unavailable during %s %s: %s",
        request.method,
        request.url.path,
        str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
    )
    return FiniteJSONResponse(
        status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
        headers={"Retry-After": "1"},
        content={"detail": "the database is unavailable for the moment; retry the request"},
    )


async def _invalid_spec(_request: Request, exc: Exception) -> FiniteJSONResponse:
    assert isinstance(exc, InvalidSpec)
    return FiniteJSONResponse(status_code=422, content={"detail": readable_errors(exc.errors, prefix=("body",))})


async def _plan_error(_request: Request, exc: Exception) -> FiniteJSONResponse:
    assert isinstance(exc, PlanError)
    error = {"type": exc.kind, "loc": tuple(exc.field.split(".")), "msg": str(exc)}
    return FiniteJSONResponse(status_code=422, content={"detail": readable_errors([error], prefix=("body",))})


async def _http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's answer, except that a 405's Allow lists the methods of every route on the path: Starlette's names
    only those of the first route it matched, and a path such as /v1/jobs has a route per method."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code != status.HTTP_405_METHOD_NOT_ALLOWED:
        return await http_exception_handler(request, exc)
    routes = [route for route in request.app.router.routes if not isinstance(route, Mount)]  # a Mount takes any method
    # Each method is tried on the router as the request's path: those some route takes in full are the allowed ones.
    allowed = [
        method
        for method in _METHODS
        if any(route.matches({**request.scope, "method": method})[0] is Match.FULL for route in routes)
    ]
    return FiniteJSONResponse(
        status_code=exc.status_code,
        content={"detail": exc.detail},
        headers={"Allow": ", ".join(allowed or ("GET", "HEAD"))},
    )  # no route: a static file's


async def _invalid_request(_request: Request, exc: Exception) -> FiniteJSONResponse:
    assert isinstance(exc, RequestValidationError)
    return FiniteJSONResponse(status_code=422, content={"detail": readable_errors(exc.errors())})


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(Unauthorized, _unauthorized)
    app.add_exception_handler(Forbidden, _forbidden)
    app.add_exception_handler(JobNotFound, _not_found)
    app.add_exception_handler(TenantNotFound, _not_found)
    app.add_exception_handler(TokenNotFound, _not_found)
    app.add_exception_handler(CodeNotFound, _not_found)
    app.add_exception_handler(CodeTooLarge, _too_large)
    app.add_exception_handler(InvalidCode, _invalid_code)
    app.add_exception_handler(InvalidTenant, _invalid_tenant)
    app.add_exception_handler(DataError, _data_error)
    app.add_exception_handler(OperationalError, _database_unavailable)
    app.add_exception_handler(InterfaceError, _database_unavailable)
    app.add_exception_handler(JobConflict, _conflict)
    app.add_exception_handler(OwnTokenRevocation, _conflict)
    app.add_exception_handler(IllegalTransition, _conflict)
    app.add_exception_handler(LogsUnavailable, _unavailable)
    app.add_exception_handler(ClusterUnavailable, _unavailable)
    app.add_exception_handler(NodeNotFound, _not_found)
    app.add_exception_handler(DrainRefused, _conflict)
    app.add_exception_handler(InvalidSpec, _invalid_spec)
    app.add_exception_handler(PlanError, _plan_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
