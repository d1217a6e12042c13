"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), as vLLM
serves it: the request becomes a chat (proxy/chat.py), so it joins sessions, rounds and
KV reuse like any chat, and its answer is written back as content blocks
(proxy/blocks.py). Agents built on Anthropic's SDK point its `base_url` at the proxy.

A request's `system` and `messages` become chat messages: text blocks their text,
`tool_use` blocks an assistant's tool calls, `tool_result` blocks tool messages (before
the rest of their user message), `thinking` blocks dropped (as chat templates drop past
reasoning). `tools` and `tool_choice` (`auto`, `any`, `tool`, `none`,
`disable_parallel_tool_use`) are the chat's tools; `thinking` turns the template's
`enable_thinking` on (or off: effort "none"), `output_config.effort` is vLLM's
`reasoning_effort`; `output_config.format` is a JSON schema the answer keeps
to; `stop_sequences`, `temperature`, `top_p`, `top_k`, `metadata.user_id` and vLLM's
`cache_salt`, `chat_template_kwargs` are the chat's. Images, documents and server tools
are 400s: this model reads text. `cache_control` marks are taken and change nothing:
every prompt's reusable KV is found without them.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from msgspec import Struct

from . import blocks
from . import tools as t
from .chat import start
from .errors import invalid
from .respond import reply
from .route import PROXY, T0, json_answer, tracked
from .schemas import EFFORTS, ChatRequest, Message, TokenDance, decode
from .structured import JsonSchema, ResponseFormat
from .tokenize import TokenizeRequest, tokenize


class Block(Struct, kw_only=True):
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking
    signature: str | None = None
    data: str | None = None  # redacted_thinking
    source: dict[str, Any] | None = None  # image, document
    cache_control: dict[str, Any] | None = None
    citations: Any = None


class Turn(Struct):
    role: str
    content: str | list[Block]


class Tool(Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom", or a server tool's versioned name
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(Struct, kw_only=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Struct, kw_only=True):
    type: str
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(Struct, kw_only=True):
    type: str = "json_schema"
    schema: dict[str, Any] | None = None


class OutputConfig(Struct, kw_only=True):
    effort: str | None = None
    format: OutputFormat | None = None


class Asked(Struct, kw_only=True):
    """What count_tokens takes: the prompt's part of a request."""

    model: str
    messages: list[Turn]
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(Asked, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    service_tier: str | None = None
    cache_salt: str | None = None  # vLLM's
    tokendance: TokenDance | None = None  # the session's tags, as chats take them


class Counted(Struct):
    input_tokens: int


THINKING = ("enabled", "adaptive", "disabled")


def routes(r: web.UrlDispatcher) -> None:
    r.add_post("/v1/messages", create)
    r.add_post("/v1/messages/count_tokens", count_tokens)


@tracked("messages")
async def create(req: web.Request) -> web.StreamResponse:
    px = req.app[PROXY]
    body = decode(await req.read(), MessagesRequest)
    asked = chat(body)
    if body.thinking is not None and body.thinking.type == "enabled" and px.config.reasoning is not None:
        asked.thinking_token_budget = body.thinking.budget_tokens  # as vLLM takes it; without a parser, taken
    call = px.call("message", asked, req.headers, req[T0])
    return await reply(req, px, call, await start(px, call, asked), blocks.write)


async def count_tokens(req: web.Request) -> web.Response:
    """The prompt's tokens, as the request would be prompted."""
    px = req.app[PROXY]
    asked = chat(decode(await req.read(), Asked))
    got = tokenize(px, TokenizeRequest(model=asked.model, messages=asked.messages, tools=asked.tools,
                                       chat_template_kwargs=asked.chat_template_kwargs))
    return json_answer(Counted(got.count))
CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat(body: Asked) -> ChatRequest:
    """The request as the chat it asks for."""
    kwargs, effort = dict(body.chat_template_kwargs or {}), None
    if body.thinking is not None:
        if body.thinking.type not in THINKING:
            raise invalid(f"thinking.type must be one of {', '.join(THINKING)}", "thinking.type")
        if body.thinking.type == "disabled":
            effort = "none"
        else:
            kwargs.setdefault("enable_thinking", True)
    out = ChatRequest(model=body.model, messages=_system(body.system) + _turns(body.messages),
                      tools=_tools(body.tools), chat_template_kwargs=kwargs or None, reasoning_effort=effort)
    if body.tool_choice is not None:
        out.tool_choice, out.parallel_tool_calls = _choice(body.tool_choice)
    if isinstance(body, MessagesRequest):
        if body.max_tokens < 1:
            raise invalid("max_tokens: must be at least 1", "max_tokens")
        user = (body.metadata or {}).get("user_id")
        user = None if user is None else str(user)
        out.max_tokens, out.stop, out.stream, out.user = body.max_tokens, body.stop_sequences, body.stream, user
        out.temperature, out.top_p, out.top_k = body.temperature, body.top_p, body.top_k
        out.cache_salt, out.tokendance = body.cache_salt, body.tokendance
        wanted = body.output_config and body.output_config.effort
        if wanted is not None:
            if wanted not in EFFORTS:
                raise invalid(f"output_config.effort must be one of {', '.join(EFFORTS)}", "output_config.effort")
            out.reasoning_effort = wanted
        fmt = body.output_config and body.output_config.format
        if fmt is not None:
            if fmt.type != "json_schema" or fmt.schema is None:
                raise invalid("output_config.format must be a json_schema with its schema", "output_config.format")
            out.response_format = ResponseFormat(type="json_schema", json_schema=JsonSchema(name="output",
                                                                                            schema=fmt.schema))
    return out


def _system(system: str | list[Block] | None) -> list[Message]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "".join(_text(b, "system") for b in system)
    return [Message(role="system", content=text)] if text else []


def _text(b: Block, where: str) -> str:
    if b.type != "text" or b.text is None:
        raise invalid(f"{where}: only text blocks are taken here, not {b.type!r}", where)
    return b.text


def _turns(turns: list[Turn]) -> list[Message]:
    if not turns:
        raise invalid("messages: at least one message is required", "messages")
    out: list[Message] = []
    for i, turn in enumerate(turns):
        where = f"messages.{i}"
        if turn.role not in ("user", "assistant", "system"):  # system: Claude Code sends instructions so
            raise invalid(f"{where}.role: must be user, assistant or system, not {turn.role!r}", f"{where}.role")
        if isinstance(turn.content, str):
            out.append(Message(role=turn.role, content=turn.content))
            continue
        texts, made, results = [], [], []
        for j, b in enumerate(turn.content):
            at = f"{where}.content.{j}"
            if b.type == "text":
                texts.append(_text(b, at))
            elif b.type == "tool_use" and turn.role == "assistant":
                if not b.id or not b.name:
                    raise invalid(f"{at}: a tool_use block needs its id and name", at)
                made.append(t.MadeCall(id=b.id, function=t.CalledFunction(name=b.name,
                                                                          arguments=json.dumps(b.input or {}))))
            elif b.type == "tool_result" and turn.role == "user":
                if not b.tool_use_id:
                    raise invalid(f"{at}: a tool_result block needs its tool_use_id", at)
                results.append(Message(role="tool", tool_call_id=b.tool_use_id, content=_result(b, at)))
            elif b.type not in ("thinking", "redacted_thinking"):
                raise invalid(f"{at}: {b.type!r} blocks are not taken in a {turn.role} message (this model "
                              "reads text, tool calls and their results)", at)
        out += results
        if texts or made or not results:
            out.append(Message(role=turn.role, content="".join(texts) if texts or not made else None,
                               tool_calls=made or None))
    return out


def _result(b: Block, where: str) -> str:
    """A tool result's text ("Error: ..." when it says the call failed)."""
    if isinstance(b.content, list):
        parts = []
        for k, c in enumerate(b.content):
            if c.get("type") != "text" or not isinstance(c.get("text"), str):
                raise invalid(f"{where}.content.{k}: a tool result's content is text here", where)
            parts.append(c["text"])
        text = "\n".join(parts)
    else:
        text = b.content or ""
    return f"Error: {text}" if b.is_error else text


def _tools(tools: list[Tool] | None) -> list[t.Tool] | None:
    if not tools:
        return None
    out = []
    for i, x in enumerate(tools):
        if x.type not in (None, "custom"):
            raise invalid(f"tools.{i}: server tools ({x.type}) are not served here; define the tool by its "
                          "input_schema", f"tools.{i}.type")
        if x.input_schema is None:
            raise invalid(f"tools.{i}.input_schema: required", f"tools.{i}.input_schema")
        schema = {"type": "object", **x.input_schema}
        out.append(t.Tool(type="function", function=t.Function(name=x.name, description=x.description,
                                                                 parameters=schema, strict=x.strict)))
    return out


def _choice(c: ToolChoice) -> tuple[str | t.NamedChoice, bool | None]:
    parallel = False if c.disable_parallel_tool_use else None
    if c.type == "tool":
        if not c.name:
            raise invalid("tool_choice.name: required when type is tool", "tool_choice.name")
        return t.NamedChoice(type="function", function=t.FunctionName(c.name)), parallel
    if c.type not in CHOICES:
        raise invalid("tool_choice.type: must be auto, any, tool or none", "tool_choice.type")
    return CHOICES[c.type], parallel
