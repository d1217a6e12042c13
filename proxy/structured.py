"""Structured outputs as clients ask for them: OpenAI's `response_format` (`json_object`,
or `json_schema` with a schema; vLLM's `structural_tag` too) and vLLM's
`structured_outputs` extra parameter (`json`, `regex`, `choice`, `grammar`,
`json_object` or `structural_tag`; the openai SDK sends it in `extra_body`). Either
becomes one `Structure` for the backend, which checks that it compiles
(backend/grammar.py) before the request waits at its round's barrier.

A structural tag is xgrammar's JSON, `{"type": "structural_tag", "format": {...}}` (or
its `format` alone), or vLLM's older form, `{"structures": [{"begin", "schema", "end"}],
"triggers": [...]}`: free text in which each trigger starts a tagged part held to its
schema."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from tokendance.backend.api import Structure

from .errors import invalid


class JsonSchema(Struct, kw_only=True):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct, kw_only=True):
    type: str
    json_schema: JsonSchema | None = None
    format: Any = None  # structural_tag
    structures: Any = None  # structural_tag, vLLM's older form
    triggers: Any = None


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
    given = {k: v for k, v in (("json", so.json), ("regex", so.regex), ("choice", so.choice),
                               ("grammar", so.grammar), ("json_object", so.json_object or None),
                               ("structural_tag", so.structural_tag))
             if v is not None}
    if len(given) != 1:
        raise invalid("structured_outputs must set exactly one of json, regex, choice, grammar, "
                      "json_object and structural_tag", "structured_outputs")
    (kind, value), = given.items()
    param, ws = f"structured_outputs.{kind}", not so.disable_any_whitespace
    if kind == "structural_tag":
        return _tag(value, param)
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
        if fmt.format is not None:
            return _tag({"format": fmt.format}, "response_format.format")
        return _tag({"structures": fmt.structures, "triggers": fmt.triggers}, "response_format")
    raise invalid("response_format.type must be text, json_object, json_schema or structural_tag, "
                  f"not {fmt.type!r}", "response_format.type")


def _tag(value: Any, param: str) -> Structure:
    """A structural tag in xgrammar's form, from any of the forms clients send."""
    if isinstance(value, str):
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError:
            raise invalid("a structural tag must be JSON", param) from None
    if not isinstance(value, dict):
        raise invalid("a structural tag must be a JSON object", param)
    if "structures" in value:
        fmt = _legacy(value.get("structures"), value.get("triggers"), param)
    elif value.get("type") == "structural_tag" or "format" in value:
        fmt = value.get("format")
    else:
        fmt = value  # a format alone
    if not isinstance(fmt, dict):
        raise invalid("a structural tag needs a format (a JSON object)", param)
    return Structure("structural_tag", _encode({"type": "structural_tag", "format": fmt}), param)


def _legacy(structures: Any, triggers: Any, param: str) -> dict[str, Any]:
    """vLLM's older structural tag as the triggered tags it stands for."""
    if not (isinstance(structures, list) and structures and all(
            isinstance(x, dict) and isinstance(x.get("begin"), str) and isinstance(x.get("end"), str)
            and isinstance(x.get("schema"), dict) for x in structures)):
        raise invalid("structures must be a non-empty list of {begin, schema, end}", param)
    if not (isinstance(triggers, list) and triggers and all(isinstance(x, str) and x for x in triggers)):
        raise invalid("triggers must be a non-empty list of non-empty strings", param)
    return {"type": "triggered_tags", "triggers": triggers,
            "tags": [{"type": "tag", "begin": x["begin"], "end": x["end"],
                      "content": {"type": "json_schema", "json_schema": x["schema"]}} for x in structures]}


def _encode(value: Any) -> str:
    return msgspec.json.encode(value).decode()
