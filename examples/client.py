"""An agent-side OpenAI client for the examples: chat completions over aiohttp, tagged
with session / agent / round, plus the round control calls."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tokendance.adapters.rounds import ProxyError, Rounds, error_message
from tokendance.adapters.tags import api_base, headers


@dataclass(slots=True)
class Reply:
    agent: str
    text: str
    usage: dict[str, Any]
    latency: float  # seconds, request sent to reply read


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
    http: aiohttp.ClientSession | None = field(default=None, repr=False)

    @property
    def rounds(self) -> Rounds:
        return Rounds(self.session, self.url, self.api_key, self.timeout)

    async def __aenter__(self) -> Client:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.http is not None:
            await self.http.close()

    async def chat(self, agent: str, round: int, messages: list[dict[str, str]]) -> Reply:
        assert self.http is not None, "use `async with Client(...)`"
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
        }
        tags = headers(self.session, agent, round, self.mode)
        tags["Authorization"] = f"Bearer {self.api_key}"
        t0 = time.perf_counter()
        async with self.http.post(f"{api_base(self.url)}/chat/completions", json=body, headers=tags) as r:
            raw = await r.read()
            if r.status != 200:
                raise ProxyError(r.status, error_message(raw))
            out = await r.json()
        text = out["choices"][0]["message"].get("content") or ""
        return Reply(agent, text, out.get("usage") or {}, time.perf_counter() - t0)
