"""The field types every API's request bodies share: strict models, whole
numbers, ids of bounded length, and fields typed wider than what is served
(so that the rest gets a 400 of its own while the OpenAPI document states only
what the server answers)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from agentserve.server.identity import MAX_ID_LENGTH


class Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def _whole(v: Any) -> Any:
    # JSON has one kind of number: 8.0 is the integer 8 (JSON Schema's `integer` says so too); 8.5 is not one
    return int(v) if isinstance(v, float) and v.is_integer() else v


def whole_number(**bounds: Any) -> Any:
    """An integer field within `bounds` (Field's ge, lt, ...): 8 or 8.0, never 8.5, "8" or true. (The
    bounds come before the validator, or pydantic leaves them out of the JSON schema.)"""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole)]


Int = whole_number()


def served(*schemas: dict[str, Any], nullable: bool = True) -> Any:
    """json_schema_extra for a field typed wider than what the server serves (so that the rest gets a 400
    of its own, `n=2: only n=1 is supported`): the OpenAPI document gives `schemas` (or null) as the
    field's values, so that a request valid by the document is one the server answers."""
    def edit(schema: dict[str, Any]) -> None:
        for k in [k for k in schema if k not in ("title", "description", "default")]:
            del schema[k]
        branches = [*schemas, *([{"type": "null"}] if nullable else [])]
        schema.update(branches[0] if len(branches) == 1 else {"anyOf": branches})
    return edit


Id = Annotated[str, Field(max_length=MAX_ID_LENGTH)]
NonEmptyId = Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)]
ToolName = Annotated[str, Field(min_length=1, max_length=256)]
