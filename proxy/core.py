"""The proxy's state and the steps of a request between parsing and streaming.

`Proxy` owns the backend, the sessions, the barrier and the metrics, and takes a `Call`
(proxy/call.py) through them.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial

import structlog

from tokendance.backend.api import (BackendError, InvalidRequest, Prepared, Request, SamplingParams, Segment,
                                    Template, Usage)
from tokendance.backend.auth import bearer
from tokendance.backend.protocol import Backend, Stream

from . import beams, tools as t
from .barrier import Barrier, Entry, Gate
from .call import Call
from .cors import Cors
from .errors import ApiError, from_backend, invalid
from .schemas import RoundOpen, Sampled, answer_id, prompt_logprobs, truncation
from .known import Known
from .peers import Peers
from .request_log import log_request
from .session import Round, Sessions, check_name, read_meta, round_number
from .stats import Metrics
from .stored import Store, Stored

log = structlog.get_logger("tokendance.proxy")


def digest(key: str) -> str:
    """An API key's namespace ("" without one)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""


@dataclass(slots=True)
class Config:
    barrier_timeout: float = 0.25  # seconds since a group's first arrival
    max_group: int = 256  # entries (HTTP requests) per group
    memory_rounds: int = 2  # outputs of this many earlier rounds are searched in a prompt
    min_shared_chars: int = 16  # shorter outputs are never marked as shared
    drain_timeout: float = 30.0
    reasoning: str | None = None  # vLLM's --reasoning-parser: "qwen3" | "deepseek_r1" (proxy/reasoning.py)
    tool_parser: str | None = None  # vLLM's --tool-call-parser (proxy/tools.py PARSERS); None: the template's
    store_bytes: int = 256 * 2**20  # stored responses, and conversations, each (proxy/stored.py)
    peers: bool = False  # share rounds with the other proxies on the MQTT broker (proxy/peers.py)
    names: tuple[str, ...] = ()  # vLLM's --served-model-name: the model's names in the API
    api_keys: frozenset[str] = frozenset()  # vLLM's --api-key: required on /v1 routes (empty: none)
    stream_interval: int = 1  # vLLM's --stream-interval: tokens per streamed chunk (a request may raise it)
    cors: Cors = Cors()  # vLLM's --allowed-origins, --allowed-methods, ... (proxy/cors.py)
    trust_chat_template: bool = False  # vLLM's --trust-request-chat-template: a request may bring its own
    response_role: str = "assistant"  # vLLM's --response-role: a chat answer's, where the prompt asks for one
    as_ids: bool = False  # vLLM's --return-tokens-as-token-ids: a request's default
    force_usage: bool = False  # vLLM's --enable-force-include-usage: every stream ends with its usage
    log_stats: bool = True  # vLLM's: a stats line every stats_every seconds while busy (--disable-log-stats)
    stats_every: float = 10.0
    log_requests: bool = False  # vLLM's --enable-log-requests: each request logged (proxy/request_log.py)
    max_log_len: int | None = None  # vLLM's --max-log-len: a logged prompt's characters or ids, at most


class Proxy:
    def __init__(self, backend: Backend, config: Config | None = None):
        self.backend = backend
        self.config = c = config or Config()
        self.sessions = Sessions(memory=c.memory_rounds, min_chars=c.min_shared_chars)
        self.barrier = Barrier(self._dispatch, c.barrier_timeout, c.max_group)
        self.metrics = Metrics()
        self.stored: Store[Stored] = Store(c.store_bytes)
        self.conversations = Store(c.store_bytes)  # proxy/conversations.py
        self.running: dict[str, asyncio.Task] = {}  # background responses being generated
        self.publish: Callable[[str, int, dict], None] | None = None  # MQTT done
        self.peers: Peers | None = None  # the other proxies of a round (proxy/peers.py)
        self.observers: list[Callable[[Call], None]] = []
        self.started = time.time()
        self._dialect: str | None = None  # the chat template's way with tools, once asked
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()

    # The steps of a request, in order.

    @property
    def names(self) -> tuple[str, ...]:
        """The model's names in the API; answers give the first."""
        return self.config.names or (self.backend.info.name,)

    def served(self, model: str) -> None:
        """A 404 unless `model` is the one served."""
        if model not in self.names:
            raise ApiError(404, f"The model `{model}` does not exist", "model", "model_not_found")

    def call(self, kind: str, body: Sampled, headers: Mapping[str, str], t0: float) -> Call:
        self.served(body.model)
        meta = read_meta(headers, body.tokendance)
        meta.owner = self.owner(headers)
        prefix = {"chat": "chatcmpl-", "completion": "cmpl-", "response": "resp_", "message": "msg_"}[kind]
        opts = body.stream_options
        usage = bool(opts and opts.include_usage) or self.config.force_usage
        named = headers.get("X-Request-Id") if kind != "response" else None  # a response's id keys its store
        as_ids = body.return_tokens_as_token_ids
        return Call(prefix + answer_id(body.request_id, named), kind, self.names[0], meta, body.n,
                    self.tenant(headers, body.cache_salt), body.stream, usage,
                    usage and opts is not None and opts.continuous_usage_stats, t0=t0,
                    prompt_logprobs=prompt_logprobs(body),
                    return_ids=body.return_token_ids, as_ids=self.config.as_ids if as_ids is None else as_ids,
                    truncate=truncation(body.truncate_prompt_tokens, self.backend.info.max_model_len),
                    truncation_side=body.truncation_side or "left", interval=self.interval(body.stream_interval),
                    beams=beams.asked(body, self.backend, meta.session))

    def interval(self, asked: int | None) -> int:
        """vLLM's: a request's stream_interval, clamped up to the server's."""
        if asked is not None and asked < 1:
            raise invalid(f"stream_interval must be at least 1, not {asked}", "stream_interval")
        return max(asked or 1, self.config.stream_interval)

    @staticmethod
    def tenant(headers: Mapping[str, str], salt: str | None = None) -> str:
        """Whose KV a request may reuse: its API key's, within vLLM's `cache_salt`."""
        key = bearer(headers)
        if salt is not None:
            if not salt:
                raise invalid("cache_salt must be a non-empty string", "cache_salt")
            key += "\0" + salt
        return digest(key)

    def owner(self, headers: Mapping[str, str]) -> str:
        """Whose sessions a request names: its API key's under --api-key (proxy/session.py)."""
        return digest(bearer(headers)) if self.config.api_keys else ""

    def dialect(self, template: Template | None = None) -> str:
        """The chat template's way with tools (proxy/tools.py), found at its first use; a
        request's own template's, asked each time (a render of one short message)."""
        if template is not None and template.chat_template is not None:
            render = partial(self.backend.render_chat, template=Template(chat_template=template.chat_template))
            try:
                return t.dialect(render, self.config.tool_parser)
            except ValueError as e:
                raise invalid(f"the request's chat_template cannot take tools here: {e}", "chat_template") from None
        if self._dialect is None:
            self._dialect = t.dialect(self.backend.render_chat, self.config.tool_parser)
        return self._dialect

    def chat_form(self, messages: list[dict], tools: t.Tools | None,
                  template: Template | None = None) -> tuple[list[dict], t.Draw]:
        """The messages to render and how (proxy/tools.py)."""
        d = self.dialect(template) if t.uses_tools(messages, tools) else t.WRITTEN
        render = self.backend.render_chat if template is None else partial(self.backend.render_chat, template=template)
        return t.form(render, d, messages, tools)

    def place(self, call: Call) -> Known:
        """Choose the round; return the earlier outputs to look for in the prompt."""
        if call.meta.session is None:
            return Known()
        call.number = self.sessions.infer(call.meta)
        return self.sessions.known(call.meta.session, call.number, call.tenant, call.meta.owner)

    def prepare(self, call: Call, prompts: list[list[Segment] | list[int]], sp: SamplingParams,
                special: bool = False) -> None:
        m = call.meta
        for prompt in prompts:
            ids = prompt and isinstance(prompt[0], int)
            for j in range(call.n):
                s = sp if j == 0 or sp.seed is None else replace(sp, seed=sp.seed + j)
                r = Request(f"{call.key}-{len(call.prepared)}", [] if ids else prompt, s, mode=m.mode,
                            session=m.session, agent=call.agent(len(call.prepared)), round=call.number,
                            prompt_token_ids=prompt if ids else None, tenant=call.tenant,
                            add_special_tokens=special, truncate=call.truncate,
                            truncation_side=call.truncation_side, whole=not call.stream)
                try:
                    self.admitted(call.id, call.kind, call.prepared, r)
                except InvalidRequest as exc:  # the engine names the chat field, "messages"
                    field = "prompt" if call.kind == "completion" else "messages"
                    raise invalid(exc.message, field if exc.param in (None, "messages") else exc.param,
                                  exc.code)
        k = len(call.prepared)
        call.texts, call.logprobs, call.scored, call.ids = ([[] for _ in range(k)] for _ in range(4))
        call.tokens, call.finish, call.stopped, call.usage = [0] * k, [None] * k, [None] * k, [None] * k

    def admitted(self, answer: str, kind: str, group: list[Prepared], r: Request) -> None:
        """The backend's preparation of `r` added to `group` (and logged under the answer's
        id, with --enable-log-requests); InvalidRequest as the backend raises it."""
        group.append(self.backend.prepare(r))
        if self.config.log_requests:
            log_request(answer, kind, group[-1], self.config.max_log_len)

    async def admit(self, call: Call) -> list[Stream]:
        """Hold the call at its round's barrier (if any); its streams once its group started."""
        if call.number is None:
            return self._alone(call, "bypass")
        rnd, call.before = self.sessions.commit(call.meta, call.number)
        call.rnd = rnd
        if self.peers is not None and call.meta.agent is not None:
            self.peers.arrived(rnd, call.meta.agent)
        rnd.active += 1
        rnd.stats.first = rnd.stats.first or call.t0
        if call.meta.resumes and (call.meta.agent is None or call.meta.agent in rnd.gate.done):
            return self._alone(call, "resume")  # a tool result: its turn's group has left
        if call.batch or call.meta.agents is not None:  # its prompts are its round's group: nobody to wait for
            rnd.stats.group_sizes.append(len(call.prepared))
            named = set(call.meta.agents or ())
            rnd.gate.done |= named  # the round's agents (whom the next round expects)
            rnd.gate.missing -= named
            return self._alone(call, "batch")
        entry = Entry(call.meta.agent, call.prepared, asyncio.get_running_loop().create_future(), tag=call)
        try:
            streams = await self.barrier.wait(rnd.gate, entry)
        except BaseException as exc:
            self.finish(call, "error" if isinstance(exc, ApiError) else "abort")
            raise
        call.released = time.perf_counter()
        call.wait, call.group = entry.released - entry.arrived, entry.group
        call.held = call.released - entry.arrived
        return streams

    def _alone(self, call: Call, reason: str) -> list[Stream]:
        """Start the call at once, in a group of its own."""
        call.released = time.perf_counter()
        self._count_group(len(call.prepared), reason)
        try:
            if call.beams is not None:
                return beams.start(self.backend, call.prepared, call.beams, call.key)
            return self.generate(call.prepared)
        except ApiError:
            self.finish(call, "error")
            raise

    def finish(self, call: Call, outcome: str | None = None) -> None:
        if call.done:
            return
        call.done = True
        call.outcome = outcome or call.outcome
        now = call.ended = time.perf_counter()
        latency = now - call.t0
        # one that failed before its first token counts none: what its engine ran is lost
        u = call.total() if call.outcome == "ok" or any(call.tokens) or any(call.usage) else Usage()
        m = self.metrics
        for kind in ("prompt", "completion", "cached", "shared", "recomputed"):
            m.tokens.inc(getattr(u, f"{kind}_tokens"), kind=kind)
        m.kv_bytes.inc(u.kv_dense_bytes, kind="dense")
        m.kv_bytes.inc(u.kv_held_bytes, kind="held")
        shared = len(u.shared_blocks)  # in a round, only those no earlier request of it read
        m.latency.observe(latency)
        if call.first:
            m.ttft.observe(call.first - call.t0)
            most = max(call.tokens)  # n choices generate side by side
            if call.outcome == "ok" and most > 1:
                m.tpot.observe((now - call.first) / (most - 1))
        m.wait.observe(call.wait)
        m.overhead.observe(call.overhead)
        if call.outcome == "abort":
            m.aborted.inc()
        rnd = call.rnd
        if rnd is not None:
            rnd.active -= 1
            shared = rnd.stats.add(u, call.wait, latency, call.outcome, call.meta.agent)
            for i, one in enumerate(call.usage if call.meta.agents else ()):  # a batch's agents, each its own
                if one is not None:
                    rnd.stats.credit(call.agent(i), one)
            rnd.stats.last = now
            if call.outcome == "ok":
                for i in range(len(call.prepared)):
                    self.sessions.remember(rnd, call.agent(i), call.said(i), call.tenant)
                    if self.peers is not None:
                        self.peers.said(rnd, call.agent(i), call.tenant, call.said(i))
            else:  # never answered (at the barrier or while generating): a retry keeps the round
                self.sessions.uncommit(call.meta, rnd, call.before)
                # awaited again with its group's retries (a batch is its own group; a stream
                # that failed after it opened is not sent again)
                if call.outcome == "error" and not call.meta.agents and not call.opened:
                    self.barrier.unanswered(rnd.gate, call.meta.agent)
            if rnd.active == 0 and not rnd.gate.pending:
                self._round_done(rnd)
        m.kv_bytes.inc(shared * u.block_bytes, kind="shared")
        for f in self.observers:
            f(call)

    # Groups.

    def _dispatch(self, gate: Gate, entries: list[Entry], reason: str) -> None:
        live = [e for e in entries if not e.future.done()]  # drop waiters cancelled meanwhile
        if not live:
            return
        size = sum(len(e.prepared) for e in live)
        live[0].tag.rnd.stats.group_sizes.append(size)
        self._count_group(size, reason)
        try:
            streams = self.generate([p for e in live for p in e.prepared])
        except ApiError as exc:
            for e in live:
                e.future.set_exception(exc.copy())
            return
        i = 0
        for e in live:
            e.future.set_result(streams[i:i + len(e.prepared)])
            i += len(e.prepared)

    def generate(self, group: list[Prepared]) -> list[Stream]:
        try:
            streams = self.backend.generate(group)
            if len(streams) != len(group):
                raise BackendError(f"{len(streams)} streams for {len(group)} requests")
            return streams
        except Exception as exc:
            self.metrics.engine_errors.inc()
            log.error("generate failed", size=len(group), error=repr(exc))
            raise from_backend(exc) from exc

    def _count_group(self, size: int, reason: str) -> None:
        self.metrics.groups.inc(reason=reason)
        self.metrics.group_size.observe(size)

    def _round_done(self, rnd: Round) -> None:
        view = rnd.view()
        log.info("round done", session=rnd.session, round=rnd.number, requests=view["requests"],
                 groups=view["groups"], reused=view["reused_tokens"])
        if self.publish is not None:
            self.publish(rnd.session, rnd.number, view)

    # Control: open, seal, stats.

    def open(self, session: str, number: int, body: RoundOpen, owner: str = "") -> Round:
        if body.timeout_ms is not None and body.timeout_ms < 0:  # all checks before any change
            raise invalid("timeout_ms must not be negative", "timeout_ms")
        for i, agent in enumerate(body.agents or ()):  # a name no request can carry never arrives
            check_name(agent, f"agents[{i}]")
        rnd = self.round(session, number, owner)
        if body.timeout_ms is not None:
            rnd.gate.timeout = body.timeout_ms / 1e3
        if body.agents is not None:
            self.barrier.expect(rnd.gate, body.agents)
        log.debug("round open", session=session, round=number, agents=body.agents)
        return rnd

    def seal(self, session: str, number: int, owner: str = "") -> Round:
        rnd = self.round(session, number, owner)
        self.barrier.seal(rnd.gate)
        return rnd

    def round(self, session: str, number: int, owner: str = "") -> Round:
        check_name(session, "session")
        return self.sessions.round(session, round_number(number, "round"), owner)

    # Lifecycle.

    def enter(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)

    def leave(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self, timeout: float | None = None) -> bool:
        """Refuse new requests, release every held group, wait for in-flight ones."""
        self.draining = True
        for s in list(self.sessions.all.values()):
            for rnd in list(s.rounds.values()):
                self.barrier.release(rnd.gate, "drain")
        self._idle.clear()
        if self.in_flight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout or self.config.drain_timeout)
            return True
        except TimeoutError:
            log.warning("drain timed out", in_flight=self.in_flight)
            return False
