"""A response of the Responses API, written from its chat call's stream: one JSON body,
or the API's stream events (`event:` and `data:` lines, as OpenAI and vLLM send them).

Both read the answer the same way, delta by delta (`Items`); a stream sends the events
as they come. Once done, a response is stored with its conversation (proxy/stored.py),
unless its request said `store: false` or it failed, and its items are added to the
conversation object it went on in, if any (proxy/conversations.py). A stream that fails sends
`response.failed` with the error. A background response is answered at once and
generated in a task of its own, stored as it goes; with `stream: true` its events go to
a feed (proxy/feed.py) that the request and later `GET`s follow.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec
from aiohttp import web
from msgspec.structs import replace

from tokendance.backend.protocol import Stream

from . import calls, conversations
from .conversations import Conversation
from .call import Call
from .core import Proxy
from .errors import ApiError, invalid
from .feed import Feed
from .items import Event, Failure, Incomplete, InputDetails, Items, OutputDetails, Response, Usage
from .replies import ReuseDetails
from .respond import chat_lp, close, failed, merged, split, thinking_of
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
    conversation: Conversation | None = None  # the one it continues and adds its items to
    inputs: bytes = b"[]"  # its input items as listed back, encoded
    items: Items = field(init=False)
    reasoning_tokens: int = 0
    seq: int = 0
    feed: Feed | None = None  # a streamed background response's events

    def _start(self, call: Call) -> None:
        self.items = Items(bool(call.prepared[0].request.sampling.logprobs))
        call.shown = [""]

    async def write(self, req: web.Request, px: Proxy, call: Call, streams: list[Stream]) -> web.StreamResponse:
        self._start(call)
        if not call.stream:
            try:
                await self._read(px, call, streams, None)
            except Exception as exc:
                raise failed(px, call, exc) from exc
            r = self._finished(call)
            self._keep(px, call, r)
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
                await self._send(resp, [Event("response.failed", response=self._failed(px, call, exc))])
                return resp
            r = self._finished(call)
            self._keep(px, call, r)
            await self._send(resp, [Event(f"response.{r.status}", response=r)])
        except ConnectionResetError:  # the client went away while we wrote
            call.outcome = "abort"
        return resp

    async def _read(self, px: Proxy, call: Call, streams: list[Stream], resp: web.StreamResponse | None) -> None:
        """Read the answer into `self.items`; its events go to `resp`, else to the feed (if any)."""
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
                else:
                    self._post(events)

    async def _send(self, resp: web.StreamResponse, events: list[Event]) -> None:
        for e in events:
            await resp.write(self._frame(e))

    def _post(self, events: list[Event]) -> None:
        if self.feed is not None:
            for e in events:
                self.feed.add(self._frame(e))

    def _frame(self, e: Event) -> bytes:
        e.sequence_number, self.seq = self.seq, self.seq + 1
        return b"event: " + e.type.encode() + b"\ndata: " + _enc.encode(e) + b"\n\n"

    def background(self, px: Proxy, call: Call) -> Response:
        """Generate the response in a task of its own, and say so: it is stored now as
        queued, then in progress once its group starts, and last as it ends (completed,
        incomplete, failed or cancelled: `POST .../cancel` cancels the task). Streamed, its
        events go to `self.feed`; a cancelled one's end with an `error` event."""
        self._start(call)
        px.enter()  # a shutdown drains it as it drains a request
        r = self._response(call, "queued")
        if self.body.stream:
            self.feed = Feed()
            self._post([Event("response.created", response=r), Event("response.queued", response=r)])
        self._store(px, call, r)
        px.running[call.id] = asyncio.create_task(self._generate(px, call, time.perf_counter()))
        return r

    async def _generate(self, px: Proxy, call: Call, queued: float) -> None:
        streams: list[Stream] = []
        waited = time.perf_counter() - queued  # for the event loop to start the task
        try:
            streams = await px.admit(call)
            call.held += waited  # not the proxy's own time (Call.overhead)
            r = self._response(call, "in_progress")
            self._post([Event("response.in_progress", response=r)])
            self._store(px, call, r)
            await self._read(px, call, streams, None)
            r = self._finished(call)
            self._post([Event(f"response.{r.status}", response=r)])
            self._keep(px, call, r)
        except asyncio.CancelledError:
            call.outcome = "abort"
            self._post([Event("error", code="response_cancelled", message="the response was cancelled")])
            self._store(px, call, self._response(call, "cancelled"))
        except Exception as exc:
            r = self._failed(px, call, exc)
            self._post([Event("response.failed", response=r)])
            self._store(px, call, r)
        finally:
            if self.feed is not None:
                self.feed.close()
            close(px, call, streams)
            px.running.pop(call.id, None)
            px.leave()

    def _failed(self, px: Proxy, call: Call, exc: Exception) -> Response:
        # an ApiError from the group's start is counted and says why already
        err = exc.body if isinstance(exc, ApiError) else failed(px, call, exc).body
        r = self._response(call, "failed")
        r.error = Failure(err.code or "server_error", err.message)
        return r

    def _finished(self, call: Call) -> Response:
        """The response as it ended: completed, or incomplete when cut off."""
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
        return r

    def _keep(self, px: Proxy, call: Call, r: Response) -> None:
        """Store the finished response with its answer, unless the request said not to, and
        add its input and output items to its conversation (unless that was deleted)."""
        if self.body.store:
            made = [(it.call_id, it.name, it.arguments) for it in r.output if it.type == "function_call"]
            self._store(px, call, r, output_message(call.shown[0], made))
        # as it is now (a peer proxy may have replaced it meanwhile), unless deleted
        c = self.conversation and px.conversations.get(self.conversation.id, self.owner)
        if c:
            m = call.meta
            c.tags = (m.session, m.agent, m.mode)
            conversations.add(px, c, msgspec.json.decode(self.inputs) + msgspec.to_builtins(r.output))

    def _store(self, px: Proxy, call: Call, r: Response, answer: Message | None = None) -> None:
        """Store `r` with its conversation, this answer last (none: it has none yet, or never will)."""
        m = call.meta
        conversation = _enc.encode([*self.history, *self.new, *([answer] if answer else [])])
        px.stored.put(call.id, Stored(_enc.encode(r), conversation, self.inputs, self.owner,
                                      (m.session, m.agent, m.mode), self.feed))

    def _response(self, call: Call, status: str) -> Response:
        b = self.body
        return Response(
            call.id, call.created, call.model, status, self.items.output if status != "in_progress" else [],
            [replace(t, strict=t.strict is not False) for t in b.tools or ()], b.tool_choice or "auto",
            b.parallel_tool_calls is not False,
            instructions=b.instructions, previous_response_id=b.previous_response_id,
            temperature=b.temperature, top_p=b.top_p, max_output_tokens=b.max_output_tokens,
            text=b.text or {"format": {"type": "text"}}, reasoning=b.reasoning, metadata=dict(b.metadata or {}),
            store=b.store, user=b.user, background=bool(b.background), truncation=b.truncation or "disabled",
            conversation={"id": self.conversation.id} if self.conversation else None)


async def follow(req: web.Request, feed: Feed, after: int, headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Send a streamed background response's events after sequence number `after`, as
    they come. A follower that goes away leaves the response running."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       **(headers or {})})
    await resp.prepare(req)
    with contextlib.suppress(ConnectionResetError):
        async for frame in feed.follow(after):
            await resp.write(frame)
    return resp


def starting_after(query: Mapping[str, str]) -> int:
    """`GET .../{id}?stream=true&starting_after=N`'s N (-1: from the first event)."""
    raw = query.get("starting_after", "-1")
    n = int(raw) if raw.lstrip("-").isdecimal() and len(raw) < 20 else None
    if n is None or n < -1:
        raise invalid("starting_after must be an integer, an event's sequence number", "starting_after")
    return n
