"""Structured outputs as clients ask for them: OpenAI's `response_format` (`json_object`,
or `json_schema` with a schema) and vLLM's `structured_outputs` extra parameter (`json`,
`regex`, `choice`, `grammar` or `json_object`; the openai SDK sends it in `extra_body`).
Either becomes one `Structure` for the backend, which checks that it compiles
(backend/grammar.py) before the request waits at its round's barrier."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from tokendance.backend.api import Structure

from .errors import invalid, unsupported


class JsonSchema(Struct, kw_only=True):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct, kw_only=True):
    type: str
    json_schema: JsonSchema | None = None


class StructuredOutputs(Struct, kw_only=True):
    """vLLM's structured_outputs; what it has beside these (its backend and fallback
    switches) is ignored."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    disable_any_whitespace: bool = False


def structure(fmt: ResponseFormat | None, so: StructuredOutputs | None) -> Structure | None:
    """The one constraint a request sets, or None; a 400 naming the field if it is malformed."""
    asked = _format(fmt)
    if so is None:
        return asked
    if asked is not None:
        raise invalid("set response_format or structured_outputs, not both", "structured_outputs")
    if so.structural_tag is not None:
        raise unsupported("structured_outputs.structural_tag")
    given = {k: v for k, v in (("json", so.json), ("regex", so.regex), ("choice", so.choice),
                               ("grammar", so.grammar), ("json_object", so.json_object or None))
             if v is not None}
    if len(given) != 1:
        raise invalid("structured_outputs must set exactly one of json, regex, choice, grammar "
                      "and json_object", "structured_outputs")
    (kind, value), = given.items()
    param, ws = f"structured_outputs.{kind}", not so.disable_any_whitespace
    if kind == "json_object":
        return Structure("json_object", param=param, whitespace=ws)
    if kind == "json":
        return Structure("json", value if isinstance(value, str) else _encode(value), param, ws)
    if kind == "choice":
        if not value or not all(value):
            raise invalid("choice must be a non-empty list of non-empty strings", param)
        return Structure("choice", _encode(value), param)
    if not value:
        raise invalid(f"{kind} must not be empty", param)
    return Structure(kind, value, param)


def _format(fmt: ResponseFormat | None) -> Structure | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Structure("json_object")
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise invalid("response_format of type json_schema needs json_schema.schema",
                          "response_format.json_schema.schema")
        return Structure("json", _encode(fmt.json_schema.schema), "response_format.json_schema.schema")
    if fmt.type == "structural_tag":
        raise unsupported("response_format.type", "response_format of type structural_tag")
    raise invalid(f"response_format.type must be text, json_object or json_schema, not {fmt.type!r}",
                  "response_format.type")


def _encode(value: Any) -> str:
    return msgspec.json.encode(value).decode()
