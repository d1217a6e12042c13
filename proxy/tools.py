"""Tool calling as the OpenAI API asks for it: `tools`, `tool_choice` (`none`, `auto`,
`required` or one named function) and `parallel_tool_calls`; assistant messages that
made calls and `tool` messages that answer them.

The template's dialect decides the format (`dialect` finds it once, by rendering a
probe). A template that renders tools and asks for Hermes calls, `<tool_call>{"name":
..., "arguments": ...}</tool_call>` (Qwen2.5's, Hermes'), or for a bare `{"name": ...,
"parameters": ...}` object (Llama 3.1-3.3's), gets the tools, calls and results as it
expects them, and its calls are read in that format (proxy/calls.py). Any other template
(SmolLM2's renders no tools at all) gets them written into the messages it renders, in
the Hermes format (`hermes`). `--tool-call-parser granite` or `phi4_mini_json` reads a
JSON list of calls after Granite's or Phi-4-mini's marker instead (proxy/listed.py), from a
template that renders tools. `required` and a named function hold the output to a JSON schema,
as vLLM does, so they work on any model; `auto` depends on the model answering in the
format, and holds a call it begins to a given function (to its parameters where the
function is `strict`) once any tool is `strict`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from msgspec import Struct

from tokendance.backend.api import InvalidRequest, Structure

from .errors import invalid, unsupported

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
_CHOICES = ("none", "auto", "required")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_PROBE = "tokendance_probe_tool"
HERMES, LLAMA3, WRITTEN = "hermes", "llama3", "written"  # dialects of chat templates
GRANITE, PHI4 = "granite", "phi4_mini"  # a JSON list of calls after a marker (proxy/listed.py)
MARKERS = {GRANITE: ("<|tool_call|>", OPEN), PHI4: ("functools",)}  # the first is the one written
# vLLM's --tool-call-parser: the formats read (a marker's list only where given, as in vLLM)
PARSERS = {"hermes": HERMES, "llama3_json": LLAMA3, "granite": GRANITE, "phi4_mini_json": PHI4}
_LLAMA3_ASK = '"parameters": dictionary of argument name'  # Llama 3.1-3.3's templates ask so
Render = Callable[..., str]  # a backend's render_chat(messages, tools=None)
Draw = Callable[[list[dict[str, Any]]], str]  # messages -> prompt text


class Function(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    type: str
    function: Function | None = None


class FunctionName(Struct):
    name: str


class NamedChoice(Struct, kw_only=True):
    type: str
    function: FunctionName


class CalledFunction(Struct, kw_only=True):
    name: str
    arguments: str | dict[str, Any]  # a JSON text, as the API has it (some clients send the object)


class MadeCall(Struct, kw_only=True):
    """A call in an assistant message of the conversation so far."""

    function: CalledFunction
    id: str | None = None
    type: str = "function"


@dataclass(slots=True)
class Tools:
    specs: list[dict[str, Any]]  # as chat templates take them
    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the named function
    parallel: bool = True
    strict: frozenset[str] = frozenset()  # functions whose calls must match their parameters
    dialect: str = WRITTEN  # the chat template's (`dialect`): the format calls are read in

    def structure(self) -> Structure | None:
        """What the output is held to: for `required` or a named choice, a JSON schema; for
        `auto` with a `strict` function, a structural tag in which every call, once begun,
        is a Hermes call of a given function, with a strict one's arguments held to its
        parameters (the text around the calls is free)."""
        fns = {s["function"]["name"]: s["function"] for s in self.specs}
        if self.choice == "auto" and self.strict:
            return self._calls(fns)
        if self.choice == "named":
            return Structure("json", json.dumps(_params(fns[self.name])), "tool_choice", whitespace=False)
        if self.choice != "required":
            return None
        defs: dict[str, Any] = {}
        items = []
        for name, fn in fns.items():
            params = dict(_params(fn))
            for k, v in params.pop("$defs", {}).items():  # "#/$defs/..." refs point at the root
                if defs.setdefault(k, v) != v:
                    raise invalid(f"tools define $defs.{k} in two different ways", "tools")
            items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                           "parameters": params},
                          "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        # JSON without free whitespace: a small model spends no tokens on layout
        return Structure("json", json.dumps(schema), "tools", whitespace=False)

    def _calls(self, fns: dict[str, dict[str, Any]]) -> Structure:
        if self.dialect == LLAMA3:
            trigger, begin, end = '{"name": ', '{{"name": {}, "parameters": ', "}"
        elif self.dialect in MARKERS:  # each call a list of one after the marker
            mark = MARKERS[self.dialect][0]
            trigger, begin, end = mark, mark + '[{{"name": {}, "arguments": ', "}]"
        else:
            trigger, begin, end = OPEN, f'{OPEN}\n{{{{"name": {{}}, "arguments": ', f"}}\n{CLOSE}"
        tags = [{"type": "tag", "begin": begin.format(json.dumps(name)),
                 "content": {"type": "json_schema",
                             "json_schema": _params(fn) if name in self.strict else {"type": "object"}},
                 "end": end} for name, fn in fns.items()]
        fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "at_least_one": False,
               "stop_after_first": not self.parallel}
        return Structure("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}), "tools")


def _params(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def check(tools: list[Tool] | None, choice: str | NamedChoice | None, parallel: bool | None) -> Tools | None:
    """The request's tools and choice, or None when it has none; a 400 naming the field."""
    if not tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice is only allowed when tools are specified", "tool_choice")
        return None
    specs, names = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if t.type != "function":
            raise unsupported(f"{where}.type", f"tools of type {t.type!r}")
        if t.function is None:
            raise invalid("a tool of type function needs its function", f"{where}.function")
        f = t.function
        if not _NAME.fullmatch(f.name):
            raise invalid("a function name is 1-64 characters of a-z, A-Z, 0-9, _ and -",
                          f"{where}.function.name")
        if f.name in names:
            raise invalid(f"two tools are named {f.name!r}", f"{where}.function.name")
        names.add(f.name)
        fn: dict[str, Any] = {"name": f.name, "description": f.description or ""}
        if f.parameters is not None:
            fn["parameters"] = f.parameters
        specs.append({"type": "function", "function": fn})
    strict = frozenset(t.function.name for t in tools if t.function is not None and t.function.strict)
    out = Tools(specs, "auto", parallel=parallel is not False, strict=strict)
    if isinstance(choice, NamedChoice):
        if choice.type != "function":
            raise invalid("tool_choice.type must be function", "tool_choice.type")
        if choice.function.name not in names:
            raise invalid(f"tool_choice names {choice.function.name!r}, which is not among tools",
                          "tool_choice.function.name")
        out.choice, out.name = "named", choice.function.name
    elif choice is not None:
        if choice not in _CHOICES:
            raise invalid("tool_choice must be none, auto, required or a named function", "tool_choice")
        out.choice = choice
    return out


def made_calls(i: int, calls: list[MadeCall]) -> list[dict[str, Any]]:
    """An assistant message's calls as templates take them: arguments as objects."""
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if c.type != "function":
            raise unsupported(f"{where}.type", f"tool calls of type {c.type!r}")
        args = c.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise invalid("arguments must be a JSON object", f"{where}.function.arguments") from None
        if not isinstance(args, dict):
            raise invalid("arguments must be a JSON object", f"{where}.function.arguments")
        out.append({"id": c.id or f"call_{i}_{j}", "type": "function",
                    "function": {"name": c.function.name, "arguments": args}})
    return out


def dialect(render: Render, parser: str | None = None) -> str:
    """How the chat template takes tools: HERMES (it renders them and asks for Hermes
    calls), LLAMA3 (it renders them and asks for a bare {"name", "parameters"} object), or
    WRITTEN (it renders none, or asks for a format read here by neither: the proxy writes
    them into the messages, in the Hermes format). `parser` (a PARSERS name, vLLM's
    --tool-call-parser) reads calls in its format from a template that renders tools,
    whatever it asks for; ValueError where the template renders none and the parser is
    not Hermes, the format the proxy writes them in."""
    probe = [{"type": "function", "function": {"name": _PROBE, "description": "",
                                                "parameters": {"type": "object", "properties": {}}}}]
    try:
        text = render([{"role": "user", "content": "hi"}], tools=probe)
    except InvalidRequest:
        text = ""
    if _PROBE not in text:
        if parser is not None and PARSERS[parser] != HERMES:
            raise ValueError(f"--tool-call-parser {parser}: the chat template renders no tools, so the "
                             "proxy writes them in and reads calls in the Hermes format (give hermes, or "
                             "a --chat-template that renders tools)")
        return WRITTEN
    if parser is not None:
        return PARSERS[parser]
    return HERMES if OPEN in text else LLAMA3 if _LLAMA3_ASK in text else WRITTEN


def uses_tools(messages: list[dict[str, Any]], tools: Tools | None) -> bool:
    return tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def hermes(messages: list[dict[str, Any]], tools: Tools | None) -> list[dict[str, Any]]:
    """The conversation for a template that renders no tools: the tools described at the
    start of the system message (where every agent given the same tools shares them as a
    prefix), each call as a <tool_call> in its assistant message, and tool results in a
    user message (consecutive ones together), as Qwen2.5's template writes them."""
    out: list[dict[str, Any]] = []
    if tools is not None:
        text = _instructions(tools.specs)
        if messages and messages[0]["role"] == "system":
            first, *messages = messages
            out.append({**first, "content": text + "\n\n" + first["content"]})
        else:
            out.append({"role": "system", "content": text})
    for m in messages:
        if m["role"] == "tool":
            reply = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("results"):
                out[-1]["content"] += "\n" + reply
            else:
                out.append({"role": "user", "content": reply, "results": True})
            continue
        calls = [call_text(c["function"]["name"], c["function"]["arguments"])
                 for c in m.get("tool_calls") or ()]
        m = {k: v for k, v in m.items() if k != "tool_calls"}
        if calls:
            m["content"] = "\n".join(([m["content"]] if m["content"] else []) + calls)
        out.append(m)
    return [{k: v for k, v in m.items() if k != "results"} for m in out]


def call_text(name: str, arguments: dict[str, Any]) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def _instructions(specs: list[dict[str, Any]]) -> str:
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in specs)
    return ("# Tools\n\nYou may call one or more functions to help with the request. "
            "The functions you can call are listed in <tools></tools> tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "To call a function, answer with a JSON object of its name and arguments in "
            f"{OPEN}{CLOSE} tags, one for each call:\n"
            f'{OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}')


def form(render: Render, dialect: str, messages: list[dict[str, Any]],
         tools: Tools | None) -> tuple[list[dict[str, Any]], Draw]:
    """The messages to render and how: with the tools given to a template that renders
    them (its `dialect` HERMES or LLAMA3), else written into the messages."""
    if not uses_tools(messages, tools):
        return messages, render
    if dialect == WRITTEN:
        return hermes(messages, tools), render
    specs = tools.specs if tools is not None else None
    return messages, lambda ms: render(ms, tools=specs)
