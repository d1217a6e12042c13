"""OpenAI's Responses API (`POST /v1/responses`), the request side: its body, and the
chat request it stands for.

A response is a chat completion underneath, so it takes the chat path whole (sessions,
the barrier, shared segments, tool calls, reasoning; proxy/app.py): its `instructions`
become the system message, its `input` items the messages after the stored conversation
that `previous_response_id` names (proxy/stored.py), its function tools chat tools and its
`text.format` a response format. What the API has and this server does not (built-in
tools, images and files) is a 400 naming the field. Conversation objects: proxy/conversations.py.

Items become messages as chat templates take them: a `function_call` is a call of the
assistant message before it (or of a new one), a `function_call_output` a tool message,
and a `reasoning` item is dropped (as templates drop earlier turns' thinking).
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec
from msgspec import Struct

from . import tools as t
from .errors import ApiError, invalid, unsupported
from .schemas import EFFORTS, ChatRequest, Message, TokenDance
from .structured import JsonSchema, ResponseFormat

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
# With `include`, what this server can add; the rest is a 400.
LOGPROBS = "message.output_text.logprobs"
INCLUDES = (LOGPROBS, "reasoning.encrypted_content")


class InputPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class Item(Struct, kw_only=True):
    """One input item; which fields it has depends on its type (a message when none)."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    summary: list[InputPart] | None = None
    encrypted_content: str | None = None


class FunctionTool(Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(Struct, kw_only=True):
    type: str
    name: str | None = None


class TextFormat(Struct, kw_only=True):
    type: str = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(Struct, kw_only=True):
    model: str
    input: str | list[Item]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: Any = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    truncation: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extra parameters
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    cache_salt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0  # under the engine's --scheduling-policy priority
    tokendance: TokenDance | None = None


def check(body: ResponsesRequest) -> None:
    """What this server does not do, as a 400 before any work (the rest is checked as the
    chat request it becomes)."""
    if body.background and not body.store:
        raise invalid("a background response is read back when done: store must be true", "store")
    if body.prompt is not None:
        raise unsupported("prompt", "prompt templates")
    if body.truncation not in (None, "disabled", "auto"):
        raise invalid("truncation must be auto or disabled", "truncation")
    if body.reasoning is not None and body.reasoning.effort not in (None, *EFFORTS):
        raise invalid(f"reasoning.effort must be one of {', '.join(EFFORTS)}", "reasoning.effort")
    for i, name in enumerate(body.include or ()):
        if name not in INCLUDES:
            raise unsupported(f"include[{i}]", f"include {name!r}")
    check_metadata(body.metadata or {})
    if body.conversation is not None and body.previous_response_id is not None:
        raise invalid("give previous_response_id or conversation, not both", "conversation")


def conversation_id(body: ResponsesRequest) -> str | None:
    """The conversation a request continues: `conversation`, its id or `{"id": ...}`."""
    c = body.conversation
    if c is None:
        return None
    if isinstance(c, dict):
        c = c.get("id")
    if not isinstance(c, str) or not c:
        raise invalid("conversation is a conversation's id, or {\"id\": ...}", "conversation")
    return c


def check_metadata(metadata: dict[str, str]) -> None:
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise invalid("metadata keys are at most 64 characters, values at most 512", "metadata")
    if len(metadata) > 16:
        raise invalid("metadata holds at most 16 pairs", "metadata")


def messages(items: str | list[Item], name: str = "input") -> list[Message]:
    """The input (or the `name` list of items) as chat messages; a 400 naming the item
    that cannot be one."""
    if isinstance(items, str):
        return [Message(role="user", content=items)]
    if not items:
        raise invalid(f"{name} must not be empty", name)
    out: list[Message] = []
    for i, it in enumerate(items):
        where = f"{name}[{i}]"
        if it.type == "message":
            if it.role not in ROLES:
                raise invalid(f"unknown role {it.role!r}", f"{where}.role")
            out.append(Message(role=it.role, content=_text(it.content, f"{where}.content")))
        elif it.type == "function_call":
            if not it.call_id or not it.name or it.arguments is None:
                raise invalid("a function_call has a call_id, a name and arguments", where)
            call = t.MadeCall(function=t.CalledFunction(name=it.name, arguments=it.arguments), id=it.call_id)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or ()), call]
            else:
                out.append(Message(role="assistant", content=None, tool_calls=[call]))
        elif it.type == "function_call_output":
            if not it.call_id or it.output is None:
                raise invalid("a function_call_output has a call_id and an output", where)
            out.append(Message(role="tool", content=_text(it.output, f"{where}.output"), tool_call_id=it.call_id))
        elif it.type != "reasoning":
            raise unsupported(f"{where}.type", f"input items of type {it.type!r}")
    return out


_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed(items: str | list[Item]) -> list[dict[str, Any]]:
    """The input as `GET /v1/responses/{id}/input_items` gives it back: each item with an
    id (its own, or one made), a message's content as parts."""
    if isinstance(items, str):
        items = [Item(role="user", content=items)]
    out = []
    for it in items:
        d = {k: v for k, v in msgspec.structs.asdict(it).items() if v is not None}
        d.setdefault("id", f"{_PREFIX[it.type]}_{secrets.token_hex(12)}")
        if it.type == "message":
            kind = "output_text" if it.role == "assistant" else "input_text"
            if isinstance(it.content, str):
                d["content"] = [{"type": kind, "text": it.content}]
            d.setdefault("status", "completed")
        out.append(msgspec.to_builtins(d))
    return out


def _text(content: str | list[InputPart] | None, where: str) -> str:
    if content is None:
        raise invalid("content is required", where)
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise unsupported(f"{where}[{j}]", f"content of type {part.type!r}")
    return "".join(part.text or "" for part in content)


def chat(body: ResponsesRequest, history: list[Message], new: list[Message],
         meta: TokenDance | None) -> ChatRequest:
    """The chat request a response stands for: instructions, the stored conversation, the
    new input; `meta`: the tokendance tags it runs under."""
    system = [Message(role="system", content=body.instructions)] if body.instructions else []
    lp = body.include is not None and LOGPROBS in body.include
    return ChatRequest(
        model=body.model, messages=system + history + new, stream=body.stream,
        max_completion_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=body.stop,
        repetition_penalty=body.repetition_penalty, cache_salt=body.cache_salt, priority=body.priority,
        logprobs=lp or None, top_logprobs=body.top_logprobs if lp else None,
        tools=_tools(body.tools), tool_choice=_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls, response_format=_format(body.text),
        chat_template_kwargs=body.chat_template_kwargs, user=body.user, tokendance=meta,
        reasoning_effort=body.reasoning.effort if body.reasoning else None)


def _tools(tools: list[FunctionTool] | None) -> list[t.Tool] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise unsupported(f"tools[{i}].type", f"tools of type {tool.type!r}")
        if not tool.name:
            raise invalid("a function tool has a name", f"tools[{i}].name")
        # The Responses API holds calls to their parameters unless strict is false.
        out.append(t.Tool(type="function", function=t.Function(
            name=tool.name, description=tool.description, parameters=tool.parameters,
            strict=tool.strict is not False)))
    return out


def _choice(choice: str | NamedTool | None) -> str | t.NamedChoice | None:
    if not isinstance(choice, NamedTool):
        return choice
    if choice.type != "function" or not choice.name:
        raise unsupported("tool_choice", f"tool_choice of type {choice.type!r}")
    return t.NamedChoice(type="function", function=t.FunctionName(choice.name))


def _format(text: TextConfig | None) -> ResponseFormat | None:
    f = text.format if text is not None else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return ResponseFormat(type="json_object")
    if f.type != "json_schema":
        raise unsupported("text.format.type", f"text format {f.type!r}")
    if f.schema is None:
        raise invalid("a json_schema format has a schema", "text.format.schema")
    return ResponseFormat(type="json_schema", json_schema=JsonSchema(
        name=f.name, schema=f.schema, strict=f.strict, description=f.description))


# A chat check's parameter, as this API names it.
_PARAMS = (("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
           ("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
           ("tool_choice.function.name", "tool_choice.name"), (".function.name", ".name"),
           (".function.parameters", ".parameters"), ("messages", "input"))


def renamed(exc: ApiError) -> ApiError:
    """A chat check's 400, in this API's names (what it says of max_tokens included)."""
    param = exc.body.param
    for old, new in _PARAMS:
        if param is not None and old in param:
            if old == "messages":  # a message's index is not its item's: the input as a whole
                exc.body.param = new
            elif old.startswith("."):
                exc.body.param = param.replace(old, new)
            else:
                exc.body.param = new + param[param.index(old) + len(old):]
            if old.startswith("max_"):
                exc.body.message = exc.body.message.replace("max_tokens", new)
            break
    return exc


def next_turn(history: list[Message], start: int) -> int:
    """Where the conversation's next turn after `start` begins (its next user message), for
    `truncation: auto` to drop whole turns, a call never without its result."""
    return next((i for i in range(start + 1, len(history)) if history[i].role == "user"), len(history))


def output_message(content: str, calls: list[tuple[str, str, str]]) -> Message:
    """The assistant's answer as the stored conversation holds it; calls: (call_id, name, arguments)."""
    made = [t.MadeCall(function=t.CalledFunction(name=n, arguments=a), id=c) for c, n, a in calls]
    return Message(role="assistant", content=content or None, tool_calls=made or None)

