"""OpenAI's deprecated function calling, served as the tools it became: `functions`,
`function_call`, assistant messages' `function_call` and messages of role `function`
are rewritten into tools, tool_choice, tool calls and tool messages before a chat's
checks, and its answer's call is given back in the old shape (`message.function_call`,
a delta's `function_call`, finish_reason `function_call`). One call an answer, as the
old API made. Clients that still speak it: the openai SDK's `functions=`, AutoGen 0.2's
`llm_config["functions"]`, LangChain's `bind_functions`."""

from __future__ import annotations

from msgspec import structs

from . import replies as s
from . import tools as t
from .errors import invalid
from .schemas import ChatRequest, Message


def legacy(body: ChatRequest) -> bool:
    """Whether the request asks in the old shape, so that its answer comes in it."""
    return body.functions is not None or body.function_call is not None


def as_tools(body: ChatRequest) -> ChatRequest:
    """The request with its functions as tools (the body itself when it has none)."""
    old = any(m.function_call is not None or m.role == "function" for m in body.messages)
    if not (legacy(body) or old):
        return body
    if body.functions is not None and body.tools is not None:
        raise invalid("give tools or functions, not both", "functions")
    if body.function_call is not None and body.functions is None:
        raise invalid("function_call needs functions", "function_call")
    if body.function_call is not None and body.tool_choice is not None:
        raise invalid("give tool_choice or function_call, not both", "function_call")
    tools, choice, parallel = body.tools, body.tool_choice, body.parallel_tool_calls
    if body.functions is not None:
        tools = [t.Tool(type="function", function=f) for f in body.functions]
        choice, parallel = _choice(body.function_call), False
        if isinstance(choice, t.NamedChoice) and choice.function.name not in {f.name for f in body.functions}:
            raise invalid(f"function_call names {choice.function.name!r}, which is not among functions",
                          "function_call.name")
    return structs.replace(body, tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
                           functions=None, function_call=None, messages=_messages(body.messages))


def _choice(call: str | t.FunctionName | None) -> str | t.NamedChoice | None:
    if call is None or isinstance(call, str):
        if call not in (None, "none", "auto"):
            raise invalid('function_call must be "none", "auto" or {"name": ...}', "function_call")
        return call
    return t.NamedChoice(type="function", function=call)


def _messages(messages: list[Message]) -> list[Message]:
    """Assistant messages' function calls as tool calls, and function results as the tool
    messages of the last call of their function."""
    out, ids = [], {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.function_call is not None:
            if m.role != "assistant":
                raise invalid("only assistant messages call functions", f"{where}.function_call")
            if m.tool_calls:
                raise invalid("give tool_calls or function_call, not both", f"{where}.function_call")
            ids[m.function_call.name] = f"call_{i}_0"
            m = structs.replace(m, tool_calls=[t.MadeCall(function=m.function_call, id=ids[m.function_call.name])],
                                function_call=None)
        elif m.role == "function":
            if not m.name:
                raise invalid("a message of role function names its function", f"{where}.name")
            m = structs.replace(m, role="tool", tool_call_id=ids.get(m.name, f"call_{m.name}"))
        out.append(m)
    return out


def finish(reason: str | None) -> str | None:
    return "function_call" if reason == "tool_calls" else reason


def message(m: s.OutMessage) -> s.OutMessage:
    """An answer's message with its call as `function_call`."""
    if m.tool_calls:
        m.function_call, m.tool_calls = m.tool_calls[0].function, None
    return m


def delta(d: s.OutDelta) -> s.OutDelta:
    """A chunk's delta with its call's piece as `function_call` (the name first, then the
    arguments as they come)."""
    if d.tool_calls:
        piece = d.tool_calls[0].function
        d.function_call, d.tool_calls = s.FunctionDelta(piece.name, piece.arguments), None
    return d
