"""Request models that read values as their JSON Schema says: an integer is a JSON integer (28 or 28.0), a number a
JSON number, a boolean true or false. Pydantic's lax mode would also take "5" or true for a number, and 1 or "yes"
for a boolean; its strict mode would refuse 28.0 for an integer, which JSON Schema calls one. No string may hold NUL,
which PostgreSQL cannot store (api.limits.NO_NUL states it in the schema)."""

from __future__ import annotations

import functools
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError


@functools.cache
def _field_kinds(model: type[BaseModel], name: str) -> frozenset[type]:
    """_kinds of a model's field, read once per field (validation runs for every report the driver sends)."""
    return frozenset(_kinds(model.model_fields[name].annotation))


def _kinds(annotation: Any) -> set[type]:
    """The scalar types a field's annotation admits (int | None -> {int, NoneType}; tuple[float, float] -> {float})."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, tuple, list):
        return {
            kind for argument in typing.get_args(annotation) if argument is not Ellipsis for kind in _kinds(argument)
        }
    return {annotation} if isinstance(annotation, type) else set()


def _check(value: Any, kinds: frozenset[type]) -> None:
    if isinstance(value, (list, tuple)):
        for item in value:
            _check(item, kinds)
    elif isinstance(value, bool):
        if bool not in kinds and kinds & {int, float}:
            raise PydanticCustomError("number_type", "Input should be a JSON number, not a boolean")
    elif isinstance(value, (str, bytes)):
        if isinstance(value, str) and "\x00" in value:  # PostgreSQL's text holds no NUL: refused on every database
            raise PydanticCustomError("string_nul", "a string holding a NUL character (\\u0000) is not accepted")
        if str not in kinds and kinds & {int, float}:
            raise PydanticCustomError("number_type", "Input should be a JSON number, not a string")
        if bool in kinds and str not in kinds:
            raise PydanticCustomError("bool_type", "Input should be true or false")
    elif isinstance(value, (int, float)) and bool in kinds and not kinds & {int, float}:
        raise PydanticCustomError("bool_type", "Input should be true or false")


class JsonTyped(BaseModel):
    """Its number and boolean fields take JSON numbers and booleans only (see the module)."""

    @field_validator("*", mode="before")
    @classmethod
    def _json_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is not None:
            _check(value, _field_kinds(cls, info.field_name))
        return value
