"""Turn a call's backend streams into an OpenAI response: one JSON body or SSE chunks.

A client that goes away aborts every unfinished stream of its call (the engine frees
their KV); an engine failure mid-stream ends an SSE response with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import structlog
from aiohttp import web
from msgspec import UNSET, UnsetType

from tokendance.backend.api import BackendError, Delta, TokenLogprob, TopLogprob
from tokendance.backend.protocol import Stream

from . import calls, functions, replies as s
from .call import Call
from .core import Proxy
from .errors import ApiError, from_backend
from .primed import primed
from .reasoning import Thinking

log = structlog.get_logger("tokendance.proxy")
_enc = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


Writer = Callable[[web.Request, Proxy, Call, list[Stream]], Awaitable[web.StreamResponse]]


async def reply(req: web.Request, px: Proxy, call: Call, streams: list[Stream],
                write: Writer | None = None) -> web.StreamResponse:
    """Answer the call (`write`: in another API's shape than chat's or completions')."""
    try:
        if call.stream:
            try:
                streams = await primed(call, streams)
            except Exception as exc:
                raise failed(px, call, exc) from exc
            call.opened = True
        if write is not None:
            return await write(req, px, call, streams)
        if call.stream:
            return await _sse(req, px, call, streams)
        return await _json(px, call, streams)
    except (asyncio.CancelledError, ConnectionResetError):  # the client went away
        call.outcome = "abort"
        raise
    finally:
        close(px, call, streams)


def close(px: Proxy, call: Call, streams: list[Stream]) -> None:
    """The call is answered, or never will be: abort its unfinished streams (the engine
    frees their KV) and count it."""
    for i, st in enumerate(streams):
        if call.finish[i] is None:
            st.abort()
    px.finish(call)


async def _json(px: Proxy, call: Call, streams: list[Stream]) -> web.Response:
    try:
        async with contextlib.aclosing(merged(call, streams)) as deltas:
            async for i, d in deltas:
                call.add(i, d)
    except Exception as exc:
        raise failed(px, call, exc) from exc
    usage = _usage(call)
    if call.kind == "chat":
        choices = []
        for i in range(len(streams)):
            r, th = calls.reader(call.tools), thinking_of(px, call)
            reasoning, text = th.whole(call.text(i)) if th else ("", call.text(i))
            got = r.whole(text)
            call.shown.append(got.content)
            content = call.echo.text(i, got.content) if call.echo else got.content
            message = s.OutMessage(call.role, content if content or not got.calls else None,
                                   [s.OutCall(c.id or "", s.OutFunction(c.name or "", c.arguments))
                                    for c in got.calls] or None, None if call.hide_reasoning else reasoning or None)
            finish = calls.finish(r, call.finish[i])
            if call.legacy:
                message, finish = functions.message(message), functions.finish(finish)
            choices.append(s.ChatChoice(i, message, finish, chat_lp(call, call.logprobs[i]), _ids(call, i)[1],
                                        call.stopped[i]))
        one = not call.batch  # a batch of chats has a prompt per choice: none of them is the call's
        body: Any = s.ChatCompletion(call.id, call.created, call.model, choices, usage,
                                     prompt_logprobs=_prompt_lp(call, call.scored[0]) if one else None,
                                     prompt_token_ids=_ids(call, 0)[0] if one else UNSET, prompt_text=_text(call))
    else:
        e = call.echo
        body = s.Completion(call.id, call.created, call.model, [
            s.TextChoice(i, e.text(i, call.text(i)) if e else call.text(i), call.finish[i],
                         _text_lp(call, e.logprobs(call.scored[i], call.logprobs[i]) if e else call.logprobs[i], 0),
                         _prompt_lp(call, call.scored[i]),
                         *_ids(call, i), call.stopped[i])
            for i in range(len(streams))], usage)
    return web.Response(body=_enc.encode(body), content_type="application/json", headers=call.headers())


async def _sse(req: web.Request, px: Proxy, call: Call, streams: list[Stream]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       **call.headers()})
    await resp.prepare(req)
    chat = call.kind == "chat"
    offsets = [0] * len(streams)
    readers = [calls.reader(call.tools) for _ in streams]
    thinking = [thinking_of(px, call) for _ in streams]
    call.shown = [""] * len(streams) if chat else []
    held: list[Delta | None] = [None] * len(streams)  # stream_interval: tokens not sent yet, per choice
    try:
        sent: list[int | None] = [None] * len(streams)  # return_token_ids: output ids sent (None: no chunk yet)
        if chat:
            await resp.write(_event(s.ChatChunk(call.id, call.created, call.model, [
                s.ChunkChoice(i, s.OutDelta(call.role, "")) for i in range(len(streams))], _so_far(call, 0),
                prompt_token_ids=_ids(call, 0)[0], prompt_text=_text(call))))
            sent = [0] * len(streams)
            if call.echo:  # vLLM's: the last message's content first
                await resp.write(_event(s.ChatChunk(call.id, call.created, call.model, [
                    s.ChunkChoice(i, s.OutDelta(content=call.echo.texts[i])) for i in range(len(streams))])))
        try:
            async with contextlib.aclosing(merged(call, streams)) as deltas:
                async for i, d in deltas:
                    call.add(i, d)
                    if call.interval > 1:
                        d, held[i] = _interval(call, d, held[i], call.tokens[i])
                        if d is None:
                            continue
                    echoed = call.echo is not None and not chat
                    text, lps = call.echo.piece(i, d, call.scored[i]) if echoed else (d.text, d.logprobs)
                    chunk = _chat_chunk(call, i, d, readers[i], thinking[i]) if chat else \
                        _text_chunk(call, i, text, lps, d, offsets[i])
                    offsets[i] += len(text)
                    if chunk is not None:
                        chunk.usage = _so_far(call, i)
                        if call.return_ids and not call.hide_reasoning:
                            _stream_ids(call, i, chunk.choices[0], sent)
                        await resp.write(_event(chunk))
        except ConnectionResetError:
            raise
        except Exception as exc:
            await resp.write(b"data: " + failed(px, call, exc).encode() + b"\n\n")
            return resp
        if call.include_usage:
            usage = _usage(call)
            last = s.ChatChunk(call.id, call.created, call.model, [], usage) if chat else \
                s.Completion(call.id, call.created, call.model, [], usage)
            await resp.write(_event(last))
        await resp.write(DONE)
    except ConnectionResetError:  # the client went away while we wrote
        call.outcome = "abort"
    return resp


def _interval(call: Call, d: Delta, held: Delta | None, tokens: int) -> tuple[Delta | None, Delta | None]:
    """vLLM's stream_interval: (the delta to send now, if any; the one held back). A
    choice's tokens go out `call.interval` at a time; its first and its last at once."""
    if held is not None:
        d = Delta(held.text + d.text, held.token_ids + d.token_ids, held.logprobs + d.logprobs, d.finish_reason,
                  d.stop_reason, d.usage, held.prompt_logprobs if held.prompt_logprobs is not None
                  else d.prompt_logprobs)
    if d.finish_reason is None and tokens > len(d.token_ids) and len(d.token_ids) < call.interval:
        return None, d
    return d, None


def _stream_ids(call: Call, i: int, choice: s.ChunkChoice | s.TextChoice, sent: list[int | None]) -> None:
    """vLLM's return_token_ids in a stream: the output ids that came since choice i's last
    chunk; a completion choice's first chunk has its prompt's too (a chat's first, the
    role chunk, had them)."""
    prompt, ids = _ids(call, i)
    if sent[i] is None:
        choice.prompt_token_ids, sent[i] = prompt, 0
    choice.token_ids, sent[i] = ids[sent[i]:], len(ids)


def _text(call: Call) -> str | UnsetType:
    """vLLM's return_prompt_text: the chat's prompt as its template wrote it."""
    return "".join(g.text for g in call.prepared[0].request.segments) if call.show_prompt else UNSET


def _ids(call: Call, i: int) -> tuple[list[int] | None | UnsetType, list[int] | UnsetType]:
    """vLLM's return_token_ids: choice i's prompt and output token ids, as its answer
    counts them (unset when not asked; the prompt's None from a backend without a tokenizer)."""
    if not call.return_ids:
        return UNSET, UNSET
    return call.prepared[i].ids, UNSET if call.hide_reasoning else [] if call.prompt_only else call.ids[i]


def failed(px: Proxy, call: Call, exc: Exception) -> ApiError:
    call.outcome = "error"
    px.metrics.engine_errors.inc()
    log.error("stream failed", id=call.id, error=repr(exc))
    return from_backend(exc)


def thinking_of(px: Proxy, call: Call) -> Thinking | None:
    """A choice's reasoning reader, with a parser set; none when a structured output is
    held from its first token (the prompt closed the think block), with nothing to read."""
    st = call.prepared[0].request.sampling.structure
    if px.config.reasoning is None or (st is not None and st.kind != "structural_tag" and not st.after):
        return None
    return Thinking(px.config.reasoning)


def split(d: Delta, r: calls.Reader, th: Thinking | None) -> tuple[str, str, list[calls.Piece]]:
    """What a chat answer's delta adds to its reasoning, its content and its tool calls."""
    reasoning, text = th.feed(d.text) if th else ("", d.text)
    if th and d.finish_reason is not None:
        more, rest = th.end()
        reasoning, text = reasoning + more, text + rest
    content, pieces = r.feed(text)
    if d.finish_reason is not None:
        more, last = r.end()
        content, pieces = content + more, pieces + last
    return reasoning, content, pieces


def _chat_chunk(call: Call, i: int, d: Delta, r: calls.Reader, th: Thinking | None) -> s.ChatChunk | None:
    """The delta as a chunk, reasoning and tool calls read out; None when it has nothing
    to say yet."""
    reasoning, content, pieces = split(d, r, th)
    call.shown[i] += content
    reasoning = "" if call.hide_reasoning else reasoning
    lp = chat_lp(call, d.logprobs)
    if not (content or reasoning or pieces or d.finish_reason or (lp and lp.content)):
        return None
    deltas = [s.CallDelta(p.index, s.FunctionDelta(p.name, p.arguments), p.id, p.id and "function")
              for p in pieces]
    delta = s.OutDelta(content=content or None, tool_calls=deltas or None, reasoning=reasoning or None)
    finish = calls.finish(r, d.finish_reason)
    if call.legacy:
        delta, finish = functions.delta(delta), functions.finish(finish)
    return s.ChatChunk(call.id, call.created, call.model, [s.ChunkChoice(i, delta, lp, finish, stop_reason=_stop(d))])


def _text_chunk(call: Call, i: int, text: str, lps: list[TokenLogprob], d: Delta, offset: int) -> s.Completion:
    return s.Completion(call.id, call.created, call.model, [
        s.TextChoice(i, text, d.finish_reason, _text_lp(call, lps, offset), stop_reason=_stop(d))])


def _stop(d: Delta) -> str | int | None | UnsetType:
    """vLLM's stop_reason in a stream: in a choice's last chunk only."""
    return UNSET if d.finish_reason is None else d.stop_reason


def _event(obj: Any) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


async def merged(call: Call, streams: list[Stream]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every stream as they come; time spent waiting goes to call.gen."""
    if len(streams) == 1:
        it = aiter(streams[0])
        while True:
            t = time.perf_counter()
            d = await anext(it, None)
            call.gen += time.perf_counter() - t
            if d is None:
                break
            yield 0, d
        _check_finished(call)
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, st: Stream) -> None:
        try:
            async for d in st:
                queue.put_nowait((i, d))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            t = time.perf_counter()
            i, d = await queue.get()
            call.gen += time.perf_counter() - t
            if d is None:
                left -= 1
            elif isinstance(d, BaseException):
                raise d
            else:
                yield i, d
        _check_finished(call)
    finally:
        for task in tasks:
            task.cancel()


def _check_finished(call: Call) -> None:
    if any(f is None for f in call.finish):
        raise BackendError("a stream ended without a finish reason")


def _so_far(call: Call, i: int) -> s.UsageOut | None:
    """vLLM's continuous usage: choice i's counts so far, in each chunk."""
    if not call.continuous_usage:
        return None
    p, c = call.prepared[i].prompt_tokens, 0 if call.prompt_only else call.tokens[i]
    return s.UsageOut(p, c, p + c)


def _usage(call: Call) -> s.UsageOut:
    u = call.total()
    if call.prompt_only:
        u.completion_tokens = 0
    return s.UsageOut(u.prompt_tokens, u.completion_tokens, u.prompt_tokens + u.completion_tokens,
                      s.CachedDetails(u.cached_tokens),
                      s.ReuseDetails(u.shared_tokens, u.recomputed_tokens, u.kv_dense_bytes, u.kv_held_bytes))


def chat_lp(call: Call, lps: list[TokenLogprob]) -> s.ChatLogprobs | None:
    if not call.prepared[0].request.sampling.logprobs or call.hide_reasoning:
        return None
    return s.ChatLogprobs([s.ChatLogprob(*_named(call, t), [
        s.TopLogprob(*_named(call, x)) for x in t.top]) for t in lps])


def _named(call: Call, t: TokenLogprob | TopLogprob) -> tuple[str, float | None, list[int]]:
    """(token, logprob, bytes) of a logprob; its token "token_id:N" under vLLM's
    return_tokens_as_token_ids."""
    if call.as_ids and t.id is not None:
        name = f"token_id:{t.id}"
        return name, t.logprob, list(name.encode())
    return t.token, t.logprob, t.bytes


def _prompt_lp(call: Call, scored: list[TokenLogprob]) -> list[dict[int, s.PromptLogprob] | None] | None:
    """vLLM's prompt_logprobs: per prompt token (None for the first), its own logprob and
    rank, then its k best alternatives', by token id."""
    if call.prompt_logprobs is None:
        return None
    k, out = call.prompt_logprobs, [None]
    for t in scored[1:]:
        d = {t.id: s.PromptLogprob(t.logprob, t.rank, t.token)}
        for rank, a in enumerate(t.top[:k], 1):
            d.setdefault(a.id, s.PromptLogprob(a.logprob, rank, a.token))
        out.append(d)
    return out


def _text_lp(call: Call, lps: list[TokenLogprob], offset: int) -> s.TextLogprobs | None:
    if not call.prepared[0].request.sampling.logprobs:
        return None
    offsets = []
    for t in lps:
        offsets.append(offset)
        offset += len(t.token)
    return s.TextLogprobs([_named(call, t)[0] for t in lps], [t.logprob for t in lps],
                          [None if t.logprob is None else {_named(call, x)[0]: x.logprob for x in t.top}
                           for t in lps], offsets)
