"""Limits on what a request may carry: its body's size (413), and the shape of a job spec document (422).

A spec is parsed into plain data first (bounded YAML or JSON), walked once to check its size, depth and
numbers, and only then validated as a JobSpec: so no input can recurse the parser to death, expand
aliases without end, or store a number the database or JSON cannot hold.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import yaml
from fastapi import HTTPException
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ringmaster.service.errors import InvalidSpec

MAX_DEPTH = 32
MAX_VALUES = 10_000
MAX_TEXT = 256 * 1024  # characters of all strings and keys together, aliases counted each time they are used
MAX_INT = 2**63 - 1  # what a BIGINT (and SQLite's INTEGER) holds


class RequestTooLarge(HTTPException):
    """An HTTPException, so FastAPI's own body parsing passes it on instead of calling it a bad body (400)."""

    def __init__(self, limit: int, setting: str = "RINGMASTER_MAX_REQUEST_BYTES") -> None:
        super().__init__(413, f"the request body exceeds the limit of {limit} bytes ({setting})")


class BodySizeLimit:
    """Refuses a body over max_bytes with 413: at once from Content-Length, else as soon as the stream passes it.

    ``per_path``: other limits for some paths, with the setting that sets each (code archives are larger than specs).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, per_path: dict[str, tuple[int, str]] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.per_path = per_path or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, setting = self.per_path.get(scope["path"], (self.max_bytes, "RINGMASTER_MAX_REQUEST_BYTES"))
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            error = RequestTooLarge(limit, setting)
            await JSONResponse({"detail": error.detail}, status_code=error.status_code)(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestTooLarge(limit, setting)
            return message

        await self.app(scope, limited, send)


def _invalid(message: str, loc: Sequence[str | int] = (), kind: str = "spec_invalid") -> InvalidSpec:
    return InvalidSpec([{"type": kind, "loc": list(loc), "msg": message}])


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with a nesting limit (its composer recurses) and without merge keys (which copy)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _invalid(f"the document nests deeper than {MAX_DEPTH} levels", kind="yaml_invalid")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        if any(key.tag == "tag:yaml.org,2002:merge" for key, _ in node.value):
            raise _invalid("YAML merge keys ('<<') are not accepted in a job spec", kind="yaml_invalid")
        super().flatten_mapping(node)


def load_yaml(body: bytes) -> Any:
    """A YAML document as plain data; InvalidSpec for anything that is not readable, bounded YAML."""
    try:
        loader = _BoundedLoader(body.decode("utf-8"))
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except UnicodeDecodeError as exc:
        raise _invalid(f"not a YAML job spec: the body is not UTF-8 ({exc.reason} at byte {exc.start})", kind="yaml_invalid") from exc
    except (yaml.YAMLError, ValueError, OverflowError, RecursionError) as exc:
        raise _invalid(f"not a YAML job spec: {exc}", kind="yaml_invalid") from exc


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def load_json(body: bytes) -> Any:
    """A JSON document as plain data; NaN and Infinity are refused, as JSON itself does."""
    try:
        return json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _invalid(f"Invalid JSON: {exc}", kind="json_invalid") from exc


def check_document(document: Any, *, finite: bool = True, loc: Sequence[str | int] = ()) -> None:
    """InvalidSpec unless the data is small and shallow enough, its integers fit 64 bits and (with finite) its floats are finite.

    Iterative, and stops at the first value past a limit, so shared (aliased) values cost what they expand to.
    """
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(document, tuple(loc))]
    values = text = 0
    while stack:
        value, path = stack.pop()
        values += 1
        if values > MAX_VALUES:
            raise _invalid(f"the document holds more than {MAX_VALUES} values", loc)
        if len(path) - len(loc) > MAX_DEPTH:
            raise _invalid(f"the document nests deeper than {MAX_DEPTH} levels", path)
        if isinstance(value, dict):
            for key, item in value.items():
                text += len(str(key))
                stack.append((item, (*path, str(key))))
        elif isinstance(value, (list, tuple)):
            stack.extend((item, (*path, index)) for index, item in enumerate(value))
        elif isinstance(value, str):
            text += len(value)
        elif isinstance(value, bool) or value is None:
            pass
        elif isinstance(value, int):
            if not -MAX_INT <= value <= MAX_INT:
                raise _invalid(f"an integer of {value.bit_length()} bits does not fit in 64", path, kind="int_too_large")
        elif isinstance(value, float):
            if finite and not math.isfinite(value):
                raise _invalid(f"{value} is not a finite number", path, kind="finite_number")
        else:  # YAML dates, binary: a JobSpec has no field of these types
            raise _invalid(f"a value of type {type(value).__name__} is not accepted here", path, kind="type_invalid")
        if text > MAX_TEXT:
            raise _invalid(f"the document's text exceeds {MAX_TEXT} characters", loc)
