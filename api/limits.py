"""Limits on what a request may carry: its body's size (413), and the shape of a job spec document (422).

A spec is parsed into plain data first (bounded YAML or JSON), walked once to check its size, depth and
numbers, and only then validated as a JobSpec: so no input can recurse the parser to death, expand
aliases without end, or store a number the database or JSON cannot hold.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

import yaml
from fastapi import HTTPException
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ringmaster.service.catalogue import MAX_INT64
from ringmaster.service.errors import InvalidSpec

MAX_DEPTH = 32
MAX_VALUES = 10_000
MAX_TEXT = 256 * 1024  # characters of all strings and keys together, aliases counted each time they are used
MAX_INT = MAX_INT64  # what a BIGINT (and SQLite's INTEGER) holds
NO_NUL = "^[^\\x00]*$"  # check_document refuses a string or key holding NUL (PostgreSQL's text and jsonb hold none)
JSON_VALUE = "JSONValue"  # the OpenAPI component of a free-form value in a checked document (state_document_rules)


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


class _BoundedLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML has no stubs: its SafeLoader is Any here
    """PyYAML's safe loader with a nesting limit (its composer recurses) and without merge keys (which copy).

    It also reads 1e-3 as a float, as YAML 1.2 does (PyYAML's YAML 1.1 wants a dot: 1.0e-3): a job spec's number is
    never a string (service.json_types).
    """

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


_BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def load_yaml(body: bytes) -> Any:
    """A YAML document as plain data; InvalidSpec for anything that is not readable, bounded YAML."""
    try:
        loader = _BoundedLoader(body.decode("utf-8"))
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except UnicodeDecodeError as exc:
        raise _invalid(
            f"not a YAML job spec: the body is not UTF-8 ({exc.reason} at byte {exc.start})", kind="yaml_invalid"
        ) from exc
    except (yaml.YAMLError, ValueError, OverflowError, RecursionError) as exc:
        raise _invalid(f"not a YAML job spec: {exc}", kind="yaml_invalid") from exc


class NotAJSONNumber(str):
    """NaN, Infinity or -Infinity where a JSON document has a value: JSON has no such numbers. Kept in the parsed
    document, so that check_document refuses it at its path."""


def load_json(body: bytes) -> Any:
    """A JSON document as plain data; check_document refuses the NaN and Infinity it may hold, as JSON itself does."""
    try:
        return json.loads(body, parse_constant=NotAJSONNumber)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _invalid(f"Invalid JSON: {exc}", kind="json_invalid") from exc


def check_document(document: Any, *, finite: bool = True, loc: Sequence[str | int] = ()) -> None:
    """InvalidSpec unless the data is small and shallow enough, its integers fit 64 bits and (with finite) its floats
    are finite.

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
                if "\x00" in str(key):
                    raise _invalid(
                        "a key holding a NUL character (\\u0000) is not accepted", path, kind="string_invalid"
                    )
                text += len(str(key))
                stack.append((item, (*path, str(key))))
        elif isinstance(value, (list, tuple)):
            stack.extend((item, (*path, index)) for index, item in enumerate(value))
        elif isinstance(value, NotAJSONNumber):
            raise _invalid(f"{value} is not a JSON number", path, kind="json_invalid")
        elif isinstance(value, str):
            if "\x00" in value:  # PostgreSQL's text and jsonb hold no NUL
                raise _invalid(
                    "a string holding a NUL character (\\u0000) is not accepted", path, kind="string_invalid"
                )
            text += len(value)
        elif isinstance(value, bool) or value is None:
            pass
        elif isinstance(value, int):
            if not -MAX_INT <= value <= MAX_INT:
                raise _invalid(
                    f"an integer of {value.bit_length()} bits does not fit in 64", path, kind="int_too_large"
                )
        elif isinstance(value, float):
            if finite and not math.isfinite(value):
                raise _invalid(f"{value} is not a finite number", path, kind="finite_number")
        else:  # YAML dates, binary: a JobSpec has no field of these types
            raise _invalid(f"a value of type {type(value).__name__} is not accepted here", path, kind="type_invalid")
        if text > MAX_TEXT:
            raise _invalid(f"the document's text exceeds {MAX_TEXT} characters", loc)


def state_document_rules(schema: dict[str, Any], json_value_ref: str) -> None:
    """State check_document's rules in a JSON Schema (in place): every integer within ±MAX_INT, no string or key
    holding NUL (unless a pattern of its own says what it holds), and every free-form value (an object's
    additionalProperties: true, a property with no schema) a JSON_VALUE, whose integers are bounded too.
    json_value_ref is where the JSON_VALUE component lies."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        if node.get("type") == "integer":
            node.setdefault("maximum", MAX_INT)
            node.setdefault("minimum", -MAX_INT)
        if node.get("type") == "string" and not {"pattern", "enum", "const"} & node.keys():
            node["pattern"] = NO_NUL
        if node.get("type") == "object" and node.get("additionalProperties", True) is True and "properties" not in node:
            node["additionalProperties"] = {"$ref": json_value_ref}
        if node.get("type") == "object" and node.get("additionalProperties") not in (None, False):
            node.setdefault("propertyNames", {"pattern": NO_NUL})
        for key, value in node.items():
            if key == "properties" and isinstance(value, dict):
                for name, property_schema in value.items():
                    if property_schema == {}:  # anything: a builder's own option
                        value[name] = {"$ref": json_value_ref}
            if key not in ("enum", "const", "default", "examples"):
                stack.append(value)


def json_value_schema(json_value_ref: str) -> dict[str, Any]:
    """The JSON_VALUE component: any JSON value check_document accepts, but for its document-wide limits (size,
    depth)."""
    return {
        "description": f"Any JSON value; integers within ±{MAX_INT}, no string or key holding NUL.",
        "anyOf": [
            {"type": "integer", "minimum": -MAX_INT, "maximum": MAX_INT},
            {"type": "number", "not": {"type": "integer"}},
            {"type": "string", "pattern": NO_NUL},
            {"type": "boolean"},
            {"type": "null"},
            {"type": "array", "items": {"$ref": json_value_ref}},
            {"type": "object", "additionalProperties": {"$ref": json_value_ref}, "propertyNames": {"pattern": NO_NUL}},
        ],
    }
