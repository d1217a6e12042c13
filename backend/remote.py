"""A Backend that drives an engine in another process: `tokendance engine` on a GPU host,
the proxy anywhere (`tokendance serve --engine URL`). The protocol is backend/wire.py.

The proxy tokenizes with the engine's own tokenizer (its files come with /info), so a
prompt too long or a bad sampling parameter is refused before the round barrier, as it is
in-process, and the engine gets token ids and the spans of the shared segments: it
tokenizes nothing. A barrier group is one POST whose answer streams every request's deltas, one
line each; aborting a request is a POST of its id. If the engine cannot be reached or the
group's answer ends early, every request still open gets a BackendError, never a hang.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import structlog

from tokendance.backend import reach, wire
from tokendance.backend.api import BackendError, Lost, Prepared, Request, Template, Unavailable, check_mode
from tokendance.backend.auth import header, refused
from tokendance.backend.grammar import Grammars
from tokendance.backend.prompt import check, fast_tokenizer, render_chat, request_ids
from tokendance.backend.protocol import Gauge, ModelInfo
from tokendance.backend.stream import QueueStream

log = structlog.get_logger(__name__)

GAUGES_EVERY = 2.0  # seconds between refreshes of the engine's gauges for /metrics


class RemoteBackend:
    def __init__(self, url: str, info: wire.Info, tokenizer: Any, mode: str = "collective",
                 timeout: float = 10.0, api_key: str | None = None):
        check_mode(mode)
        self.url = url.rstrip("/")
        self.info = ModelInfo(info.name, info.max_model_len, info.kv_bytes_per_token, info.sampling, info.priority,
                              tuple(info.eos), info.max_logprobs)
        self.vocab_size = info.vocab_size
        self.tokenizer = tokenizer
        self.grammars = Grammars(tokenizer, info.vocab_size)  # checks structured outputs' specs
        self.mode = mode
        self.timeout = timeout  # to connect, and for the small calls
        self.headers = header(api_key)  # the engine's key, when it requires one (backend/auth.py)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()
        self._gauges: list[Gauge] = []
        self._watching = False
        self._problem: str | None = None

    @classmethod
    async def connect(cls, url: str, mode: str = "collective", timeout: float = 10.0,
                      api_key: str | None = None, trust_remote_code: bool = False) -> "RemoteBackend":
        """Ask the engine at `url` for its model and tokenizer (one whose class is code it
        sends runs here only with `trust_remote_code`); BackendError if it cannot answer."""
        t = aiohttp.ClientTimeout(total=max(timeout, 60.0), connect=timeout)
        try:
            async with aiohttp.ClientSession(timeout=t, headers=header(api_key)) as s, \
                    s.get(url.rstrip("/") + wire.PREFIX + "/info") as r:
                body = await r.read()
                if r.status == 401:
                    raise BackendError(refused(url, api_key))
                if r.status != 200:
                    raise BackendError(f"{url} answered {wire.PREFIX}/info with HTTP {r.status}: "
                                       "is it a `tokendance engine`?")
                info = wire.decode(body, wire.Info)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise BackendError(f"no engine at {url}: {e or type(e).__name__}") from e
        return cls(url, info, _tokenizer(info.tokenizer, trust_remote_code), mode, timeout, api_key)

    # -- the Backend protocol ------------------------------------------------------------

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template: Template | None = None) -> str:
        return render_chat(self.tokenizer, messages, tools, template)

    def prepare(self, request: Request) -> Prepared:
        request.mode = request.mode or self.mode
        check_mode(request.mode)
        ids, spans = request_ids(self.tokenizer, request)
        check(ids, request.sampling, self.info.max_model_len, self.vocab_size, self.grammars,
              request.pooling is not None, self.info.priority, self.info.max_logprobs)
        # What the engine gets: the tokens, tokenized here once with its own tokenizer.
        return Prepared(request, len(ids), replace(request, segments=[], prompt_token_ids=ids, shared_spans=spans),
                        ids)

    def generate(self, group: list[Prepared]) -> list[QueueStream]:
        streams = [QueueStream(p.request.id, self) for p in group]
        self._spawn(self._run([p.state for p in group], streams))
        return streams

    def gauges(self) -> list[Gauge]:
        """The engine's, at most GAUGES_EVERY old once asked for (refreshed from then on)."""
        if not self._watching:
            self._watching = True
            self._spawn(self._watch())
        return self._gauges

    def problem(self) -> str | None:
        """Whether the engine answered its last poll (polled every GAUGES_EVERY once asked)."""
        self.gauges()
        return self._problem

    def abort(self, rid: str) -> None:
        self._spawn(self._post("/abort", wire.Abort([rid])))

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    # -- the wire ------------------------------------------------------------------------

    async def _run(self, requests: list[Request], streams: list[QueueStream]) -> None:
        error: BaseException | None = None
        try:
            s = self._client()
            async with s.post(self.url + wire.PREFIX + "/generate", data=wire.encoder.encode(requests),
                              headers={"Content-Type": "application/json"}) as r:
                if r.status != 200:
                    raise reach.answered(f"the engine at {self.url}", r.status, await _why(r), GAUGES_EVERY)
                buf, again = b"", set()
                async for chunk in r.content.iter_any():  # lines of any length
                    *lines, buf = (buf + chunk).split(b"\n")
                    for line in lines:
                        if line:
                            self._deliver(wire.decode_event(line), streams, again)
        except asyncio.CancelledError:
            error = BackendError("the proxy is shutting down")
            raise
        except BackendError as e:
            error = e
            if isinstance(e, Unavailable):  # it answered that it cannot serve: a fleet sends it nothing more
                self._lost(str(e))
        except Exception as e:  # unreachable, reset, a malformed line: the group's open requests fail
            error = reach.lost(f"the engine at {self.url}", e, GAUGES_EVERY)
            self._lost(str(error))
        finally:
            open_ = [st for st in streams if not st.done and not st.ended]
            if open_:
                if error is None:
                    self._lost(f"the engine at {self.url} ended a group's answer early")
                err = error or Lost("the engine ended the group's answer early")
                log.error("remote group failed", requests=len(open_), error=str(err))
                for st in open_:
                    st.put(err)

    def _lost(self, why: str) -> None:
        """Report a problem at once (a fleet sends nothing more here) until the engine
        answers a poll again."""
        self._problem = why
        self.gauges()  # the poll that clears it

    def _deliver(self, ev: wire.Event, streams: list[QueueStream], again: set[int]) -> None:
        if not 0 <= ev.i < len(streams):
            raise BackendError(f"the engine answered request {ev.i} of a group of {len(streams)}")
        st = streams[ev.i]
        if st.done and not st.ended and ev.i not in again:
            # aborted before the engine had it: it is generating for nobody, ask again
            again.add(ev.i)
            self.abort(st.rid)
        if ev.failure is not None:
            st.put(wire.raised(ev.failure))
        elif ev.delta is not None:
            st.put(ev.delta)

    async def _watch(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        while True:
            try:
                async with self._client().get(self.url + "/health", timeout=timeout) as r:
                    if r.status != 200:
                        raise BackendError(wire.decode(await r.read(), wire.WireError).message
                                           if r.status == 503 else f"HTTP {r.status}")
                async with self._client().get(self.url + wire.PREFIX + "/gauges", timeout=timeout) as r:
                    self._gauges = wire.decode(await r.read(), list[Gauge])
                    self._problem = None
            except Exception as e:  # /metrics shows the last figures meanwhile, /health why
                why = f": {e}" if isinstance(e, BackendError) else f" does not answer: {e or type(e).__name__}"
                if self._problem is None:
                    log.warning("engine unavailable", error=repr(e))
                self._problem = f"the engine at {self.url}{why}"
            await asyncio.sleep(GAUGES_EVERY)

    async def _post(self, path: str, body: Any) -> None:
        try:
            async with self._client().post(self.url + wire.PREFIX + path, data=wire.encoder.encode(body),
                                           headers={"Content-Type": "application/json"},
                                           timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                await r.read()
        except Exception as e:  # the group's own answer reports a lost engine
            log.warning("engine call failed", path=path, error=repr(e))

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # made in the serving loop, on first use
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=self.timeout),
                connector=aiohttp.TCPConnector(limit=0), headers=self.headers)
        return self._session

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _why(r: aiohttp.ClientResponse) -> str:
    """An endpoint's error answer: its WireError's message, or the start of the body."""
    body = await r.read()
    try:
        return wire.decode(body, wire.WireError).message
    except msgspec.DecodeError:
        return body[:500].decode(errors="replace")


def _tokenizer(files: dict[str, str], trust_remote_code: bool = False) -> Any:
    """A fast HF tokenizer from the engine's tokenizer files; code among them (a tokenizer
    class of its own) runs only with `trust_remote_code`."""
    code = sorted(name for name in files if name.endswith(".py"))
    if code and not trust_remote_code:
        raise BackendError(f"the engine's tokenizer is code of its own ({', '.join(code)}): give "
                           "--trust-remote-code here too to run it")
    with tempfile.TemporaryDirectory(prefix="tokendance-tok-") as d:
        for name, text in files.items():
            if "/" in name or name.startswith("."):
                raise BackendError(f"the engine sent a tokenizer file named {name!r}")
            Path(d, name).write_text(text, encoding="utf-8")
        return fast_tokenizer(d, "the engine's tokenizer", trust_remote_code)
