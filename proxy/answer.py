"""A response of the Responses API, written from its chat call's stream: one JSON body,
or the API's stream events (`event:` and `data:` lines, as OpenAI and vLLM send them).

Both read the answer the same way, delta by delta (`Items`); a stream sends the events
as they come. Once done, a response is stored with its conversation (proxy/stored.py),
unless its request said `store: false` or it failed. A stream that fails sends
`response.failed` with the error.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import msgspec
from aiohttp import web
from msgspec.structs import replace

from tokendance.backend.api import Stream

from . import calls
from .core import Call, Proxy
from .items import Event, Failure, Incomplete, InputDetails, Items, OutputDetails, Response, Usage
from .replies import ReuseDetails
from .respond import chat_lp, failed, merged, split, thinking_of
from .responses import ResponsesRequest, output_message
from .schemas import Message
from .stored import Stored

_enc = msgspec.json.Encoder()


@dataclass(slots=True)
class Turn:
    """One /v1/responses request on its way out."""

    body: ResponsesRequest
    new: list[Message]  # its input, as messages
    history: list[Message]  # the stored conversation it continues
    owner: str  # who may read it back
    inputs: bytes = b"[]"  # its input items as listed back, encoded
    items: Items = field(init=False)
    reasoning_tokens: int = 0
    seq: int = 0

    async def write(self, req: web.Request, px: Proxy, call: Call, streams: list[Stream]) -> web.StreamResponse:
        self.items = Items(bool(call.prepared[0].request.sampling.logprobs))
        call.shown = [""]
        if not call.stream:
            try:
                await self._read(px, call, streams, None)
            except Exception as exc:
                raise failed(px, call, exc) from exc
            r = self._done(px, call)
            return web.Response(body=_enc.encode(r), content_type="application/json", headers=call.headers())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **call.headers()})
        await resp.prepare(req)
        try:
            start = self._response(call, "in_progress")
            await self._send(resp, [Event("response.created", response=start),
                                    Event("response.in_progress", response=start)])
            try:
                await self._read(px, call, streams, resp)
            except ConnectionResetError:
                raise
            except Exception as exc:
                err = failed(px, call, exc).body
                r = self._response(call, "failed")
                r.error = Failure(err.code or "server_error", err.message)
                await self._send(resp, [Event("response.failed", response=r)])
                return resp
            r = self._done(px, call)
            await self._send(resp, [Event(f"response.{r.status}", response=r)])
        except ConnectionResetError:  # the client went away while we wrote
            call.outcome = "abort"
        return resp

    async def _read(self, px: Proxy, call: Call, streams: list[Stream], resp: web.StreamResponse | None) -> None:
        reader, th = calls.reader(call.tools), thinking_of(px, call)
        lp = call.prepared[0].request.sampling.logprobs
        async with contextlib.aclosing(merged(call, streams)) as deltas:
            async for i, d in deltas:
                call.add(i, d)
                thinking = th is not None and not th.closed
                reasoning, content, pieces = split(d, reader, th)
                if thinking and not content:  # tokens before the answer's content began
                    self.reasoning_tokens += len(d.token_ids)
                call.shown[0] += content
                # The message's logprobs: its tokens' from where the thinking ended
                lps = chat_lp(call, d.logprobs).content if lp and (content or not thinking) else []
                events = self.items.feed(reasoning, content, pieces, lps)
                if d.finish_reason is not None:
                    events += self.items.end(d.finish_reason == "length")
                if resp is not None:
                    await self._send(resp, events)

    async def _send(self, resp: web.StreamResponse, events: list[Event]) -> None:
        for e in events:
            e.sequence_number, self.seq = self.seq, self.seq + 1
            await resp.write(b"event: " + e.type.encode() + b"\ndata: " + _enc.encode(e) + b"\n\n")

    def _done(self, px: Proxy, call: Call) -> Response:
        """The finished response, stored unless the request said not to."""
        r = self._response(call, "incomplete" if call.finish[0] == "length" else "completed")
        if r.status == "incomplete":
            r.incomplete_details = Incomplete("max_output_tokens")
        else:
            r.completed_at = int(time.time())
        u = call.total()
        reasoning = self.reasoning_tokens if any(it.type == "reasoning" for it in r.output) else 0
        r.usage = Usage(u.prompt_tokens, InputDetails(u.cached_tokens), u.completion_tokens,
                        OutputDetails(reasoning), u.prompt_tokens + u.completion_tokens,
                        ReuseDetails(u.shared_tokens, u.recomputed_tokens, u.kv_dense_bytes, u.kv_held_bytes))
        if self.body.store:
            made = [(it.call_id, it.name, it.arguments) for it in r.output if it.type == "function_call"]
            m = call.meta
            conversation = _enc.encode([*self.history, *self.new, output_message(call.shown[0], made)])
            px.stored.put(call.id, Stored(_enc.encode(r), conversation, self.inputs, self.owner,
                                          (m.session, m.agent, m.mode)))
        return r

    def _response(self, call: Call, status: str) -> Response:
        b = self.body
        return Response(
            call.id, call.created, call.model, status, self.items.output if status != "in_progress" else [],
            [replace(t, strict=t.strict is not False) for t in b.tools or ()], b.tool_choice or "auto",
            b.parallel_tool_calls is not False,
            instructions=b.instructions, previous_response_id=b.previous_response_id,
            temperature=b.temperature, top_p=b.top_p, max_output_tokens=b.max_output_tokens,
            text=b.text or {"format": {"type": "text"}}, reasoning=b.reasoning, metadata=dict(b.metadata or {}),
            store=b.store, user=b.user)
