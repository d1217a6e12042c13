"""One HTTP request on its way through the proxy (proxy/core.py): its n choices for each
of its prompts, what the backend gave each, and its timings."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from tokendance.backend.api import Delta, Prepared, TokenLogprob, Usage

from . import tools as t
from .beams import Beams
from .echo import Echo
from .errors import invalid
from .session import Meta, Round


@dataclass(slots=True, eq=False)
class Call:
    id: str  # the answer's (a client may choose it: proxy/schemas.answer_id)
    kind: str  # "chat" | "completion" | "response"
    model: str
    meta: Meta
    n: int
    tenant: str = ""
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's)
    interval: int = 1  # vLLM's stream_interval: tokens per streamed chunk, the first and last aside
    prepared: list[Prepared] = field(default_factory=list)
    tools: t.Tools | None = None
    number: int | None = None  # the round, when in a session
    rnd: Round | None = None
    before: int = 0  # the agent's round count before this call (restored if it goes unanswered)
    created: int = field(default_factory=lambda: int(time.time()))
    t0: float = field(default_factory=time.perf_counter)
    released: float = 0.0  # resumed after the barrier
    first: float = 0.0  # its first token arrived
    ended: float = 0.0
    wait: float = 0.0  # held at the barrier until its group was released
    held: float = 0.0  # from joining the barrier to resuming (wait, then the event loop's queue)
    gen: float = 0.0  # waiting for the backend's deltas
    group: int = 1
    texts: list[list[str]] = field(default_factory=list)
    shown: list[str] = field(default_factory=list)  # a chat choice's content, tool calls read out
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    stopped: list[str | int | None] = field(default_factory=list)  # vLLM's stop_reason: what stopped each choice
    usage: list[Usage | None] = field(default_factory=list)
    outcome: str = "ok"  # "ok" | "error" | "abort"
    done: bool = False
    echo: Echo | None = None  # a completion's `echo`, or a chat's (proxy/echo.py)
    prompt_logprobs: int | None = None  # vLLM's field: alternatives to list per prompt token
    return_ids: bool = False  # vLLM's return_token_ids: the prompt's and each choice's token ids
    as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs' tokens as "token_id:N"
    # vLLM's include_reasoning false, with a reasoning parser: no reasoning in the answer,
    # nor the logprobs and output token ids that would spell it out
    hide_reasoning: bool = False
    role: str = "assistant"  # a chat answer's: --response-role, or the last message's (proxy/chat.py)
    show_prompt: bool = False  # vLLM's return_prompt_text: a chat's answer gives its prompt's text
    truncate: int | None = None  # vLLM's truncate_prompt_tokens, resolved (Request.truncate)
    truncation_side: str = "left"  # the end `truncate` cuts (Request.truncation_side)
    batch: bool = False  # a batch of chats: its round's group, started at once
    beams: Beams | None = None  # vLLM's use_beam_search (proxy/beams.py): its choices are the n best beams
    legacy: bool = False  # asked with the deprecated functions: its call answered as function_call
    # its stream was answered 200: an error now ends it as an event, which clients do not
    # send again (as they do an HTTP error)
    opened: bool = False
    key: str = field(default_factory=lambda: secrets.token_hex(12))  # its requests' ids begin with it: unique
    ids: list[list[int]] = field(default_factory=list)  # each choice's output token ids
    scored: list[list[TokenLogprob]] = field(default_factory=list)  # each choice's prompt tokens'

    def add(self, i: int, d: Delta) -> None:
        if not self.first and d.token_ids:
            self.first = d.at or time.perf_counter()
        self.texts[i].append(d.text)
        self.logprobs[i].extend(d.logprobs)
        if d.prompt_logprobs is not None:
            self.scored[i] = d.prompt_logprobs
        self.tokens[i] += len(d.token_ids)
        self.ids[i] += d.token_ids
        if d.finish_reason is not None:
            self.finish[i] = d.finish_reason
            self.stopped[i] = d.stop_reason
            self.usage[i] = d.usage

    @property
    def prompt_only(self) -> bool:
        """A completion's `echo` with max_tokens 0: the token generated is left out."""
        return self.echo is not None and self.echo.only

    @property
    def overhead(self) -> float:
        """Time the proxy itself spent on this request."""
        return max(self.ended - self.t0 - self.held - self.gen, 0.0)

    def agent(self, i: int) -> str | None:
        """Whose prompt the call's i-th request is: a batch's conversation's agent, else the call's."""
        m = self.meta
        return m.agents[i // self.n] if m.agents else m.agent

    def check_agents(self, prompts: int) -> None:
        """A 400 unless `tokendance.agents`, if given, names an agent per prompt."""
        agents = self.meta.agents
        if agents is not None and len(agents) != prompts:
            raise invalid(f"tokendance.agents names {len(agents)} agents for {prompts} prompts: one per "
                          "conversation of a batch of chats, or per prompt of a completion", "tokendance.agents")

    def text(self, i: int) -> str:
        return "".join(self.texts[i])

    def said(self, i: int) -> str:
        """What the client got as the choice's text (its content, without tool calls)."""
        return self.shown[i] if self.shown else self.text(i)

    def total(self) -> Usage:
        """Usage of the whole call: prompt numbers once per prompt, the rest summed."""
        u = Usage()
        for i, p in enumerate(self.prepared):
            c = self.usage[i] or Usage(prompt_tokens=p.prompt_tokens)
            if i % self.n == 0:
                u.prompt_tokens += c.prompt_tokens
                u.cached_tokens += c.cached_tokens
                u.recomputed_tokens += c.recomputed_tokens
                u.shared_tokens += c.shared_tokens
            u.completion_tokens += c.completion_tokens if self.usage[i] else self.tokens[i]
            u.kv_dense_bytes += c.kv_dense_bytes
            u.kv_held_bytes += c.kv_held_bytes
            u.shared_blocks = tuple(dict.fromkeys(u.shared_blocks + c.shared_blocks))
            u.block_bytes = u.block_bytes or c.block_bytes
        return u

    def headers(self) -> dict[str, str]:
        h = {"X-Request-Id": self.id}
        if self.rnd is not None:
            h |= {"X-TokenDance-Session": self.rnd.session, "X-TokenDance-Round": str(self.rnd.number),
                  "X-TokenDance-Group": str(self.group)}
            if self.meta.agent is not None:
                h["X-TokenDance-Agent"] = self.meta.agent
        return h
