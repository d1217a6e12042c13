"""A Backend that drives a vLLM server through its OpenAI API (`tokendance serve --vllm
URL`): the proxy's sessions, rounds, barrier, MQTT and round stats in front of vLLM's
engine, e.g. to run a simulation through both stacks with one client.

vLLM reuses KV only as prefix caching does, so this backend serves `full` and `prefix`:
`prefix` requests of one API key share vLLM's prefix cache (their `cache_salt` is the
key's tenant), a `full` request gets a salt of its own and so reuses nothing. The proxy
tokenizes with the model's tokenizer (`--tokenizer`, by default the folder vLLM loaded
the model from) and sends token ids; each request is one streamed /v1/completions call,
and aborting it closes that call (vLLM then aborts the request).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import asdict, replace
from typing import Any

import aiohttp
import structlog

from tokendance.backend import hub, reach
from tokendance.backend.api import (BackendError, Delta, InvalidRequest, Lost, Prepared, Request,
                                    TokenLogprob, Template, TopLogprob, Unavailable, Usage, check_mode)
from tokendance.backend.auth import header, refused
from tokendance.backend.detok import Pieces
from tokendance.backend.generation import defaults, ends
from tokendance.backend.grammar import Grammars
from tokendance.backend.prompt import check, fast_tokenizer, render_chat, request_ids
from tokendance.backend.protocol import Gauge, ModelInfo
from tokendance.backend.stream import QueueStream

log = structlog.get_logger(__name__)
SERVED = ("full", "prefix")
POLL = 2.0  # seconds between looks at a lost server's /health


class VLLMBackend:
    def __init__(self, url: str, model: str, max_model_len: int, tokenizer: Any, mode: str = "prefix",
                 timeout: float = 10.0, api_key: str | None = None, sampling: dict[str, float] | None = None,
                 eos: tuple[int, ...] = ()):
        self.url = url.rstrip("/")
        # vLLM does not say its KV bytes per token. The proxy sends every sampling field, so
        # it applies the model's defaults itself, as the server would (`sampling`).
        self.info = ModelInfo(model, max_model_len, 0, sampling or {}, priority=True, eos=eos, max_logprobs=-1)
        self.tokenizer = tokenizer
        self.grammars = Grammars(tokenizer, len(tokenizer))  # checks structured outputs' specs
        self.pieces = Pieces(tokenizer)  # a logprob's token text, as the engine writes it
        self.mode = _served(mode)
        self.timeout = timeout
        self.headers = header(api_key)  # vLLM's --api-key, when it has one (backend/auth.py)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._problem: str | None = None
        self._watch: asyncio.Task | None = None  # polls /health while the server is lost

    @classmethod
    async def connect(cls, url: str, tokenizer: str | None = None, mode: str = "prefix",
                      timeout: float = 10.0, api_key: str | None = None,
                      generation: tuple[str, dict[str, Any] | None] = ("auto", None),
                      trust_remote_code: bool = False, revision: str | None = None,
                      download_dir: str | None = None) -> "VLLMBackend":
        """Ask the server at `url` for its model; BackendError if it cannot answer.
        `generation`: the server's --generation-config and --override-generation-config,
        read here from the model folder (the tokenizer's) as vLLM reads them. The tokenizer's
        folder: `tokenizer`, else the server's model; either may be a hub id, found in the
        Hugging Face cache at `revision` (under `download_dir`) as vLLM found it."""
        _served(mode)
        t = aiohttp.ClientTimeout(total=max(timeout, 30.0), connect=timeout)
        try:
            async with aiohttp.ClientSession(timeout=t, headers=header(api_key)) as s, \
                    s.get(url.rstrip("/") + "/v1/models") as r:
                if r.status == 401:
                    raise BackendError(refused(url, api_key))
                if r.status != 200:
                    raise BackendError(f"{url} answered /v1/models with HTTP {r.status}: is it a vLLM server?")
                card = (await r.json())["data"][0]
                name, max_len, root = card["id"], int(card["max_model_len"]), card.get("root") or card["id"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError) as e:
            raise BackendError(f"no vLLM server at {url}: {e or type(e).__name__}") from e
        try:
            where = hub.folder(tokenizer or root, revision, download_dir,
                               "--tokenizer" if tokenizer else f"the model {url} serves", "tokenizer")
        except InvalidRequest as e:
            raise BackendError(str(e)) from None
        tok = fast_tokenizer(where, f"the tokenizer at {where} (--tokenizer: a model folder or a cached hub id)",
                             trust_remote_code)
        return cls(url, name, max_len, tok, mode, timeout, api_key, defaults(where, *generation), ends(where, tok))

    # -- the Backend protocol ------------------------------------------------------------

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template: Template | None = None) -> str:
        return render_chat(self.tokenizer, messages, tools, template)

    def prepare(self, request: Request) -> Prepared:
        mode = _served(request.mode or self.mode)
        if request.sampling.prompt_logprobs is not None:
            raise InvalidRequest("prompt logprobs (prompt_logprobs, or echo with logprobs) need the TokenDance "
                                 "engine: this proxy streams from its vLLM server", "prompt_logprobs")
        ids, spans = request_ids(self.tokenizer, request)
        # the vLLM server refuses a priority, or more logprobs, than it takes
        check(ids, request.sampling, self.info.max_model_len, len(self.tokenizer), self.grammars,
              request.pooling is not None, priority=True, max_logprobs=-1)
        return Prepared(request, len(ids), replace(request, mode=mode, segments=[], prompt_token_ids=ids,
                                                   shared_spans=spans), ids)

    def generate(self, group: list[Prepared]) -> list[QueueStream]:
        streams = []
        for p in group:
            st = QueueStream(p.request.id, self)
            task = asyncio.get_running_loop().create_task(self._one(p.state, st))
            self._tasks[st.rid] = task
            task.add_done_callback(lambda _, rid=st.rid: self._tasks.pop(rid, None))
            streams.append(st)
        return streams

    def gauges(self) -> list[Gauge]:
        return []

    def problem(self) -> str | None:
        """Why the last call to the server failed, until one succeeds or its /health
        answers again (polled every POLL seconds: a fleet sends a lost server no calls)."""
        return self._problem

    def abort(self, rid: str) -> None:
        task = self._tasks.get(rid)
        if task is not None:
            task.cancel()  # closes the call; vLLM aborts a request whose client went away

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *([self._watch] if self._watch else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    # -- one request -----------------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # made in the serving loop, on first use
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=self.timeout),
                                                  connector=aiohttp.TCPConnector(limit=0), headers=self.headers)
        return self._session

    def _lost(self, why: str) -> None:
        self._problem = why
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        while self._problem is not None:
            await asyncio.sleep(POLL)
            try:
                async with self._client().get(self.url + "/health",
                                              timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                    if r.status == 200:
                        log.info("vLLM server back", url=self.url)
                        self._problem = None
            except Exception:  # still lost
                pass

    async def _one(self, req: Request, st: QueueStream) -> None:
        shared = sum(b - a for a, b in req.shared_spans)  # reported, not used: vLLM has no segments
        last: Delta | None = None  # the finishing delta, held for the usage that follows it
        try:
            if req.pooling is not None:
                st.put(await self._embedding(req))
                return
            async with self._client().post(self.url + "/v1/completions", json=self._body(req)) as r:
                if r.status != 200:
                    raise _refused(r.status, await r.text())
                self._problem = None
                async for line in r.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for c in chunk.get("choices") or []:
                        d = _delta(c, self.pieces, req.sampling.logprob_token_ids)
                        if d.finish_reason is None:
                            st.put(d)
                        else:
                            last = d
                    if chunk.get("usage"):
                        last = last or Delta()
                        last.usage = _usage(chunk["usage"], shared)
            if last is None or last.finish_reason is None:
                raise Lost(f"the vLLM server at {self.url} ended a request's stream early")
            last.usage = last.usage or Usage()
            st.put(last)
        except (InvalidRequest, BackendError) as e:
            if isinstance(e, (Unavailable, Lost)):  # it cannot serve, or broke: a fleet sends it nothing more
                self._lost(str(e))
            st.put(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # unreachable, reset, a malformed chunk
            self._lost(f"the vLLM server at {self.url} does not answer: {e or type(e).__name__}")
            st.put(reach.lost(f"the vLLM server at {self.url}", e, POLL))

    async def _embedding(self, req: Request) -> Delta:
        """An embedding request as one call to the server's /v1/embeddings (a server that
        serves no embeddings refuses it: a 400 at the proxy)."""
        body = {"model": self.info.name, "input": req.prompt_token_ids, "encoding_format": "float",
                "use_activation": req.pooling.normalize}
        async with self._client().post(self.url + "/v1/embeddings", json=body) as r:
            if r.status != 200:
                raise _refused(r.status, await r.text())
            self._problem = None
            got = await r.json()
        return Delta(finish_reason="stop", embedding=got["data"][0]["embedding"],
                     usage=_usage(got.get("usage") or {}, 0))

    def _body(self, req: Request) -> dict[str, Any]:
        s = req.sampling
        body: dict[str, Any] = {
            "model": self.info.name, "prompt": req.prompt_token_ids, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True,
            # vLLM ends at the context too, but some versions refuse a length past it
            "max_tokens": min(s.max_tokens, self.info.max_model_len - len(req.prompt_token_ids or ())),
            "temperature": s.temperature, "top_p": s.top_p,
            "stop": s.stop, "stop_token_ids": s.stop_token_ids, "ignore_eos": s.ignore_eos,
            "min_p": s.min_p, "min_tokens": s.min_tokens, "include_stop_str_in_output": s.include_stop_str_in_output,
            "skip_special_tokens": s.skip_special_tokens,
            "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
            "repetition_penalty": s.repetition_penalty,
            # `full` reuses nothing: a salt of its own; `prefix` shares the key's prefix cache
            "cache_salt": secrets.token_hex(8) if req.mode == "full" else f"tenant-{req.tenant}",
        }
        if s.top_k:
            body["top_k"] = s.top_k
        if s.seed is not None:
            body["seed"] = s.seed
        if s.priority:
            body["priority"] = s.priority
        if s.logit_bias:
            body["logit_bias"] = {str(k): v for k, v in s.logit_bias.items()}
        if s.logprobs:  # by id: their text is written as our engine writes it (_delta)
            body["logprobs"], body["return_tokens_as_token_ids"] = s.top_logprobs, True
        if s.logprobs and s.logprob_token_ids:  # vLLM then lists the sampled token and these
            body["logprobs"], body["logprob_token_ids"] = len(s.logprob_token_ids), s.logprob_token_ids
        if s.allowed_token_ids is not None:
            body["allowed_token_ids"] = s.allowed_token_ids
        if s.bad_words:
            body["bad_words"] = s.bad_words
        if s.repetition is not None:
            body["repetition_detection"] = asdict(s.repetition)
        if s.think_budget is not None:  # the server knows a think block by its own reasoning config
            body["thinking_token_budget"] = s.think_budget.tokens
        if s.structure is not None:  # vLLM's structured_outputs, which the kinds mirror
            st = s.structure
            so = body["structured_outputs"] = {st.kind: True if st.kind == "json_object" else
                                               json.loads(st.spec) if st.kind in ("json", "choice") else st.spec}
            if not st.whitespace and st.kind in ("json", "json_object"):
                so["disable_any_whitespace"] = True
        return body


def _served(mode: str) -> str:
    check_mode(mode)
    if mode not in SERVED:
        raise InvalidRequest(f"mode {mode!r} needs the TokenDance engine; a vLLM server serves "
                             f"{' and '.join(SERVED)}", "mode")
    return mode


def _refused(status: int, text: str) -> Exception:
    """vLLM's 4xx is the client's mistake (a 400 at the proxy); anything else the server's."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text[:500]
    if 400 <= status < 500:
        return InvalidRequest(f"the vLLM server refused the request: {message}")
    return reach.answered("the vLLM server", status, message, POLL)


def _delta(c: dict[str, Any], pieces: Pieces, labels: list[int] | None = None) -> Delta:
    """A streamed choice as a Delta; its logprobs' tokens come as "token_id:N". With
    `labels` (logprob_token_ids) its alternatives are those, in their order, as the engine
    lists them (vLLM lists the sampled token among them too)."""
    d = Delta(c.get("text") or "", list(c.get("token_ids") or []), finish_reason=c.get("finish_reason"),
              stop_reason=c.get("stop_reason"))
    lp = c.get("logprobs")
    if lp:
        tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
        for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], tops):
            alts = [(_id(t), v) for t, v in (top or {}).items()]
            if labels:
                got = dict(alts)
                alts = [(t, got[t]) for t in labels if t in got]
            (s, b), *texts = pieces([_id(tok)] + [a for a, _ in alts])
            d.logprobs.append(TokenLogprob(s, val, b, [TopLogprob(ts, v, tb, a) for (ts, tb), (a, v)
                                                       in zip(texts, alts)], _id(tok)))
    return d


def _id(token: str) -> int:
    """vLLM's "token_id:N" (its return_tokens_as_token_ids) as N."""
    try:
        return int(token.removeprefix("token_id:"))
    except ValueError:
        raise BackendError(f"the vLLM server named a logprob's token {token[:40]!r}, not its id") from None


def _usage(u: dict[str, Any], shared: int) -> Usage:
    details = u.get("prompt_tokens_details") or {}
    return Usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0),
                 cached_tokens=details.get("cached_tokens") or 0, shared_tokens=shared)
