"""OpenAI's Responses API, the answer side: the response object, its output items, and
the stream events that build them (proxy/answer.py writes them).

`Items` takes an answer as it comes, already split into reasoning, content and tool-call
pieces (proxy/reasoning.py, proxy/calls.py), and keeps its output items in the order the
model wrote them: a `reasoning` item, a `message` with one `output_text` part, a
`function_call` per call. Each step returns the events a stream sends for it: an item is
added when its first text comes and done when the next one begins or the answer ends.
"""

from __future__ import annotations

import secrets
from typing import Any

from msgspec import Struct, field

from .calls import Piece
from .replies import ChatLogprob, ReuseDetails


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class OutputText(Struct):
    text: str
    annotations: list[Any] = field(default_factory=list)
    logprobs: list[ChatLogprob] | None = None
    type: str = "output_text"


class MessageItem(Struct):
    id: str
    content: list[OutputText]
    status: str = "in_progress"
    role: str = "assistant"
    type: str = "message"


class CallItem(Struct):
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: str = "in_progress"
    type: str = "function_call"


class ReasoningText(Struct):
    text: str
    type: str = "reasoning_text"


class ReasoningItem(Struct):
    id: str
    content: list[ReasoningText] = field(default_factory=list)
    summary: list[Any] = field(default_factory=list)
    status: str = "in_progress"
    type: str = "reasoning"


Item = MessageItem | CallItem | ReasoningItem


class InputDetails(Struct):
    cached_tokens: int


class OutputDetails(Struct):
    reasoning_tokens: int


class Usage(Struct):
    input_tokens: int
    input_tokens_details: InputDetails
    output_tokens: int
    output_tokens_details: OutputDetails
    total_tokens: int
    tokendance: ReuseDetails


class Incomplete(Struct):
    reason: str


class Failure(Struct):
    code: str
    message: str


class Response(Struct):
    id: str
    created_at: int
    model: str
    status: str
    output: list[Item]
    tools: list[Any]
    tool_choice: Any
    parallel_tool_calls: bool
    usage: Usage | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    text: Any = None
    reasoning: Any = None
    metadata: dict[str, str] = field(default_factory=dict)
    store: bool = True
    user: str | None = None
    incomplete_details: Incomplete | None = None
    error: Failure | None = None
    completed_at: int | None = None
    truncation: str = "disabled"
    background: bool = False
    conversation: dict[str, str] | None = None  # {"id": ...}: the conversation it went on
    object: str = "response"


class Event(Struct, omit_defaults=True):
    """One stream event; which fields it has depends on its type."""

    type: str
    sequence_number: int | None = None  # set as it is sent
    response: Response | None = None
    output_index: int | None = None
    item_id: str | None = None
    content_index: int | None = None
    item: Item | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    logprobs: list[ChatLogprob] | None = None
    code: str | None = None  # an `error` event's
    message: str | None = None


class Items:
    def __init__(self, logprobs: bool):
        self.output: list[Item] = []
        self.logprobs = logprobs
        self._open: Item | None = None
        self._calls: dict[int, CallItem] = {}  # by the call's index in the answer
        self._held: list[ChatLogprob] = []  # logprobs of text the message has not shown yet

    def feed(self, reasoning: str, content: str, pieces: list[Piece], lps: list[ChatLogprob]) -> list[Event]:
        out: list[Event] = []
        if reasoning:
            it = self._item(ReasoningItem, out)
            it.content[0].text += reasoning
            out.append(self._event("response.reasoning_text.delta", it, content_index=0, delta=reasoning))
        self._held.extend(lps)
        if content:
            it = self._item(MessageItem, out)
            part = it.content[0]
            part.text += content
            lp, self._held = self._held, []
            if self.logprobs:
                part.logprobs = (part.logprobs or []) + lp
            out.append(self._event("response.output_text.delta", it, content_index=0, delta=content,
                                   logprobs=lp))
        for p in pieces:
            call = self._calls.get(p.index)
            if call is None:
                call = self._calls[p.index] = CallItem(_id("fc"), p.id or _id("call"), p.name or "")
                self._add(call, out)
            if p.arguments:
                call.arguments += p.arguments
                out.append(self._event("response.function_call_arguments.delta", call, delta=p.arguments))
        return out

    def end(self, incomplete: bool) -> list[Event]:
        """The last item's done events: cut off by the token limit, it is incomplete."""
        return self._close("incomplete" if incomplete else "completed")

    def _item(self, kind: type, out: list[Event]) -> Any:
        """The open item if it is of this kind, else a new one (the open one done)."""
        if isinstance(self._open, kind):
            return self._open
        it = kind(_id({MessageItem: "msg", ReasoningItem: "rs"}[kind]), [])
        self._add(it, out)
        return it

    def _add(self, it: Item, out: list[Event]) -> None:
        out.extend(self._close())
        self.output.append(it)
        self._open = it
        out.append(Event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(it)))
        if isinstance(it, MessageItem):
            it.content.append(OutputText("", logprobs=[] if self.logprobs else None))
            out.append(self._event("response.content_part.added", it, content_index=0, part=OutputText("")))
        elif isinstance(it, ReasoningItem):
            it.content.append(ReasoningText(""))

    def _close(self, status: str = "completed") -> list[Event]:
        it, self._open = self._open, None
        if it is None:
            return []
        it.status = status
        out = []
        if isinstance(it, MessageItem):
            part = it.content[0]
            out.append(self._event("response.output_text.done", it, content_index=0, text=part.text,
                                   logprobs=part.logprobs or []))
            out.append(self._event("response.content_part.done", it, content_index=0, part=part))
        elif isinstance(it, ReasoningItem):
            out.append(self._event("response.reasoning_text.done", it, content_index=0, text=it.content[0].text))
        else:
            out.append(self._event("response.function_call_arguments.done", it, arguments=it.arguments))
        out.append(Event("response.output_item.done", output_index=self._index(it), item=it))
        return out

    def _event(self, type: str, it: Item, **kw: Any) -> Event:
        return Event(type, output_index=self._index(it), item_id=it.id, **kw)

    def _index(self, it: Item) -> int:
        return next(i for i, x in enumerate(self.output) if x is it)


def _copy(it: Item) -> Item:
    """An item as it is when added: nothing in it yet."""
    if isinstance(it, CallItem):
        return CallItem(it.id, it.call_id, it.name)
    return type(it)(it.id, [])
