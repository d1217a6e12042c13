"""An agent-side OpenAI client for the examples: chat completions over aiohttp, tagged
with session / agent / round, plus the round control calls. With `api="responses"` it
speaks OpenAI's Responses API instead: each agent continues its own stored conversation
by `previous_response_id` and sends only what its chat added since; with
`api="conversations"` each agent's conversation is a conversation object
(`/v1/conversations`) that its responses go on in; with `api="messages"` it speaks
Anthropic's Messages API (`/v1/messages`); with `api="batch"` a round's chats go in one
request (`/v1/chat/completions/batch`, `round`). `embed` gives texts' embeddings, and
`judge` texts' probability of a yes (vLLM's `/generative_scoring`), for agents' memories.
An answer the openai SDK would send again (the proxy's 503 when it could not reach its
engine, any 5xx) is sent again as it would be (adapters/retry.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog

from tokendance.adapters.retry import RETRIES, backoff
from tokendance.adapters.rounds import ProxyError, Rounds, error_message
from tokendance.adapters.tags import api_base, headers

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Reply:
    agent: str
    text: str
    usage: dict[str, Any]
    latency: float  # seconds, request sent to reply read
    finish: str = ""  # its finish_reason (chat and batch)


@dataclass
class Client:
    url: str
    session: str
    mode: str | None = None
    model: str = "default"
    max_tokens: int = 48
    temperature: float = 0.0
    seed: int = 0
    api_key: str = "tokendance"
    timeout: float = 600.0
    api: str = "chat"  # or "responses", "conversations", "messages", "batch"
    repetition: dict[str, int] | None = None  # vLLM's repetition_detection (chat and batch)
    retries: int = RETRIES  # how often a request is sent again (adapters/retry.py)
    http: aiohttp.ClientSession | None = field(default=None, repr=False)
    # per agent, its last response (or its conversation object) and the conversation it holds
    chains: dict[str, tuple[str, list[dict[str, str]]]] = field(default_factory=dict, repr=False)
    labels: dict[str, int] = field(default_factory=dict, repr=False)  # a label's token id, once asked

    @property
    def rounds(self) -> Rounds:
        return Rounds(self.session, self.url, self.api_key, self.timeout, self.retries)

    async def __aenter__(self) -> Client:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.http is not None:
            await self.http.close()

    async def chat(self, agent: str, round: int, messages: list[dict[str, str]]) -> Reply:
        if self.api == "messages":
            return await self._message(agent, round, messages)
        if self.api != "chat":
            return await self._respond(agent, round, messages)
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
        }
        if self.repetition is not None:
            body["repetition_detection"] = self.repetition
        t0 = time.perf_counter()
        out = await self._post("/chat/completions", body, agent, round)
        choice = out["choices"][0]
        return Reply(agent, choice["message"].get("content") or "", out.get("usage") or {},
                     time.perf_counter() - t0, choice.get("finish_reason") or "")

    async def round(self, round: int, chats: dict[str, list[dict[str, str]]]) -> list[Reply]:
        """Every agent's chat of `round` in one batch of chats, each conversation named by
        its agent (`tokendance.agents`): a reply each, the first
        with the call's usage (the batch reports one), the others with none, so that
        sums over the replies count it once."""
        body = {"model": self.model, "messages": list(chats.values()), "max_tokens": self.max_tokens,
                "temperature": self.temperature, "seed": self.seed, "tokendance": {"agents": list(chats)}}
        if self.repetition is not None:
            body["repetition_detection"] = self.repetition
        t0 = time.perf_counter()
        out = await self._post("/chat/completions/batch", body, None, round)
        took = time.perf_counter() - t0
        choices = sorted(out["choices"], key=lambda c: c["index"])
        return [Reply(agent, c["message"].get("content") or "", out.get("usage") or {} if i == 0 else {}, took,
                      c.get("finish_reason") or "") for i, (agent, c) in enumerate(zip(chats, choices))]

    async def _message(self, agent: str, round: int, messages: list[dict[str, str]]) -> Reply:
        """The chat as an Anthropic message: its system message the system prompt."""
        system = [m["content"] for m in messages if m["role"] == "system"]
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                                "messages": [m for m in messages if m["role"] != "system"]}
        if system:
            body["system"] = "\n".join(system)
        t0 = time.perf_counter()
        out = await self._post("/messages", body, agent, round)
        text = "".join(b["text"] for b in out["content"] if b["type"] == "text")
        u = out["usage"]  # in chat's words, for the round table
        prompt = u["input_tokens"] + u["cache_read_input_tokens"]
        usage = {"prompt_tokens": prompt, "completion_tokens": u["output_tokens"],
                 "prompt_tokens_details": {"cached_tokens": u["cache_read_input_tokens"]},
                 "tokendance": u.get("tokendance", {})}
        return Reply(agent, text, usage, time.perf_counter() - t0)

    async def _respond(self, agent: str, round: int, messages: list[dict[str, str]]) -> Reply:
        """The chat as a response: its system message the instructions, and only what
        follows the agent's stored conversation, when the chat starts with it."""
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        rest = messages[1:] if system is not None else messages
        body: dict[str, Any] = {"model": self.model, "input": rest, "max_output_tokens": self.max_tokens,
                                "temperature": self.temperature, "seed": self.seed}
        prev, stored = self.chains.get(agent, (None, []))
        goes_on = prev is not None and rest[:len(stored)] == stored
        if goes_on:
            body["input"] = rest[len(stored):]
        if system is not None:
            body["instructions"] = system
        t0 = time.perf_counter()
        if self.api == "conversations":
            if not goes_on:
                prev = (await self._post("/conversations", {}, agent, round))["id"]
            body["conversation"] = prev
        elif goes_on:
            body["previous_response_id"] = prev
        out = await self._post("/responses", body, agent, round)
        text = "".join(c["text"] for o in out["output"] if o["type"] == "message" for c in o["content"])
        kept = prev if self.api == "conversations" else out["id"]
        self.chains[agent] = (kept, [*rest, {"role": "assistant", "content": text}])
        u = out["usage"]  # in chat's words, for the round table
        usage = {"prompt_tokens": u["input_tokens"], "completion_tokens": u["output_tokens"],
                 "prompt_tokens_details": u["input_tokens_details"], "tokendance": u.get("tokendance", {})}
        return Reply(agent, text, usage, time.perf_counter() - t0)

    async def embed(self, texts: list[str]) -> list[list[float]]:
        """Each text's embedding (the served model's, /v1/embeddings), in their order."""
        out = await self._post("/embeddings", {"model": self.model, "input": texts, "encoding_format": "float"})
        return [d["embedding"] for d in sorted(out["data"], key=lambda d: d["index"])]

    async def judge(self, items: list[str], question: str, yes: str = " Yes", no: str = " No") -> list[float]:
        """Each item's probability of `yes` against `no` as the next token after it and the
        question (vLLM's `/generative_scoring`, every item in one call); the labels' token
        ids from `/tokenize`, asked once."""
        for label in (yes, no):
            if label not in self.labels:
                got = await self._post("/tokenize", {"model": self.model, "prompt": label, "add_special_tokens": False},
                                       root=True)
                self.labels[label] = got["tokens"][0]
        out = await self._post("/generative_scoring", {
            "model": self.model, "query": question, "items": items, "item_first": True,
            "label_token_ids": [self.labels[yes], self.labels[no]]}, root=True)
        return [d["score"] for d in sorted(out["data"], key=lambda d: d["index"])]

    async def _post(self, path: str, body: dict[str, Any], agent: str | None = None,
                    round: int | None = None, root: bool = False) -> dict[str, Any]:
        """`root`: a route outside /v1 (vLLM's /tokenize, /generative_scoring)."""
        assert self.http is not None, "use `async with Client(...)`"
        tags = headers(self.session, agent, round, self.mode)
        tags["Authorization"] = f"Bearer {self.api_key}"
        base = api_base(self.url)
        for attempt in itertools.count():
            async with self.http.post((base.removesuffix("/v1") if root else base) + path, json=body,
                                      headers=tags) as r:
                raw = await r.read()
                if r.status == 200:
                    return json.loads(raw)
                wait = backoff(r.status, r.headers, attempt)
                if wait is None or attempt >= self.retries:
                    raise ProxyError(r.status, error_message(raw))
                log.warning("sending again", agent=agent, status=r.status, error=error_message(raw),
                            wait=f"{wait:.2f} s", retry=f"{attempt + 1} of {self.retries}")
            await asyncio.sleep(wait)
