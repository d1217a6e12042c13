"""A Messages API answer (proxy/messages.py) written from its chat call's stream: one
JSON message, or Anthropic's stream events (`message_start`, a `content_block_start`,
`_delta`s and `_stop` per block, `message_delta`, `message_stop`).

Both read the answer the same way, delta by delta (`Blocks`): the reasoning a parser
reads out (`--reasoning-parser`) is a `thinking` block, the content a `text` block, each
tool call a `tool_use` block whose input streams as `input_json_delta`s. The stop
reason is Anthropic's: `max_tokens` for a length cut, `tool_use` when the model called a
tool, `stop_sequence` (naming it) for a stop sequence, else `end_turn`. Usage counts the
prompt tokens whose KV was reused as `cache_read_input_tokens`, the rest as
`input_tokens`, and adds the reuse details as chats give them (`tokendance`).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from tokendance.backend.protocol import Stream

from . import calls
from .call import Call
from .core import Proxy
from .errors import ApiError
from .respond import failed, merged, split, thinking_of

_enc = msgspec.json.Encoder()


@dataclass(slots=True)
class Blocks:
    """The answer's content blocks as they grow; each call returns the events it makes."""

    content: list[dict[str, Any]] = field(default_factory=list)
    open: str | None = None  # the type of the last block, while it takes more
    args: dict[int, str] = field(default_factory=dict)  # each tool_use block's input so far, by call index
    at: dict[int, int] = field(default_factory=dict)  # each call's block index

    def feed(self, reasoning: str, text: str, pieces: list[calls.Piece]) -> list[dict[str, Any]]:
        events = []
        if reasoning:
            events += self._grow("thinking", {"thinking": reasoning}, {"type": "thinking_delta", "thinking": reasoning})
        if text:
            events += self._grow("text", {"text": text}, {"type": "text_delta", "text": text})
        for p in pieces:
            if p.id is not None:  # a new call
                events += self._stop()
                self.at[p.index] = len(self.content)
                self.args[p.index] = ""
                self.content.append({"type": "tool_use", "id": p.id, "name": p.name or "", "input": {}})
                events.append({"type": "content_block_start", "index": self.at[p.index],
                               "content_block": self.content[-1]})
                self.open = "tool_use"
            if p.arguments:
                self.args[p.index] += p.arguments
                events.append({"type": "content_block_delta", "index": self.at[p.index],
                               "delta": {"type": "input_json_delta", "partial_json": p.arguments}})
        return events

    def _grow(self, kind: str, add: dict[str, str], delta: dict[str, str]) -> list[dict[str, Any]]:
        events = []
        if self.open != kind:
            events += self._stop()
            empty = {"type": kind, **{k: "" for k in add}} | ({"signature": ""} if kind == "thinking" else {})
            self.content.append(empty)
            events.append({"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(empty)})
            self.open = kind
        for k, v in add.items():
            self.content[-1][k] += v
        events.append({"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta})
        return events

    def _stop(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def end(self) -> list[dict[str, Any]]:
        """The last block closed; each tool_use block's input parsed ({} where it is not an object)."""
        for i, text in self.args.items():
            with contextlib.suppress(ValueError):
                got = json.loads(text or "{}")
                self.content[self.at[i]]["input"] = got if isinstance(got, dict) else {}
        return self._stop()


def stop_reason(call: Call, b: Blocks) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for the call's one choice."""
    if call.finish[0] == "length":
        return "max_tokens", None
    if b.args:
        return "tool_use", None
    if isinstance(call.stopped[0], str):
        return "stop_sequence", call.stopped[0]
    return "end_turn", None


def usage(call: Call, output: bool = True) -> dict[str, Any]:
    u = call.total()
    out = {"input_tokens": u.prompt_tokens - u.cached_tokens, "cache_creation_input_tokens": 0,
           "cache_read_input_tokens": u.cached_tokens, "output_tokens": u.completion_tokens if output else 0}
    out["tokendance"] = {"shared_tokens": u.shared_tokens, "recomputed_tokens": u.recomputed_tokens,
                         "kv_dense_bytes": u.kv_dense_bytes, "kv_held_bytes": u.kv_held_bytes}
    return out


def message(call: Call, b: Blocks, done: bool) -> dict[str, Any]:
    reason, seq = stop_reason(call, b) if done else (None, None)
    if not done:
        prompt = sum(p.prompt_tokens for p in call.prepared)
        use = {"input_tokens": prompt, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
               "output_tokens": 0}
    else:
        use = usage(call)
    return {"id": call.id, "type": "message", "role": "assistant", "model": call.model,
            "content": b.content if done else [], "stop_reason": reason, "stop_sequence": seq, "usage": use}


async def write(req: web.Request, px: Proxy, call: Call, streams: list[Stream]) -> web.StreamResponse:
    """The answer, whole or as stream events (respond.reply closes the call after)."""
    b = Blocks()
    call.shown = [""]
    if not call.stream:
        try:
            await _read(px, call, streams, b, None)
        except Exception as exc:
            raise failed(px, call, exc) from exc
        return web.Response(body=_enc.encode(message(call, b, True)), content_type="application/json",
                            headers=call.headers())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       **call.headers()})
    await resp.prepare(req)
    try:
        await _send(resp, [{"type": "message_start", "message": message(call, b, False)}, {"type": "ping"}])
        try:
            await _read(px, call, streams, b, resp)
        except ConnectionResetError:
            raise
        except Exception as exc:
            err = exc if isinstance(exc, ApiError) else failed(px, call, exc)
            await _send(resp, [{"type": "error", "error": {"type": "api_error", "message": err.body.message}}])
            return resp
        reason, seq = stop_reason(call, b)
        await _send(resp, [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                            "usage": usage(call)}, {"type": "message_stop"}])
    except ConnectionResetError:  # the client went away while we wrote
        call.outcome = "abort"
    return resp


async def _read(px: Proxy, call: Call, streams: list[Stream], b: Blocks, resp: web.StreamResponse | None) -> None:
    reader, th = calls.reader(call.tools), thinking_of(px, call)
    async with contextlib.aclosing(merged(call, streams)) as deltas:
        async for i, d in deltas:
            call.add(i, d)
            reasoning, content, pieces = split(d, reader, th)
            call.shown[0] += content
            events = b.feed(reasoning, content, pieces)
            if d.finish_reason is not None:
                events += b.end()
            if resp is not None:
                await _send(resp, events)


async def _send(resp: web.StreamResponse, events: list[dict[str, Any]]) -> None:
    for e in events:
        await resp.write(b"event: " + e["type"].encode() + b"\ndata: " + _enc.encode(e) + b"\n\n")
