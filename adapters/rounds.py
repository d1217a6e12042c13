"""Round control over HTTP: announce who takes part in a round, seal it, read its stats,
or send the whole round at once.

    POST /v1/tokendance/sessions/{session}/rounds/{round}        {"agents": [...]}
    POST /v1/tokendance/sessions/{session}/rounds/{round}/seal
    GET  /v1/tokendance/sessions/{session}/rounds/{round}
    POST /v1/chat/completions/batch                              (`chats`)

Announcing lets the proxy release a round's barrier as soon as every named agent has
arrived; sealing releases it with whoever is there; `chats` sends every agent's chat of
a round in one batch, which needs neither. Plain stdlib HTTP, so the helper works from
any framework's thread; the `a*` variants run it off the event loop. An answer the
openai SDK would send again (a 503 when the proxy could not reach its engine, any 5xx,
a 429) is sent again as it would be (adapters/retry.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from tokendance.adapters.retry import RETRIES, backoff
from tokendance.adapters.tags import api_base



class ProxyError(RuntimeError):
    """The proxy answered a control request with an error."""

    def __init__(self, status: int, message: str):
        super().__init__(f"proxy answered {status}: {message}")
        self.status = status


@dataclass(slots=True)
class Rounds:
    """Round control for one session on one proxy."""

    session: str
    url: str | None = None
    api_key: str = "tokendance"
    timeout: float = 30.0
    retries: int = RETRIES  # how often a request is sent again (adapters/retry.py)

    def path(self, round: int, tail: str = "") -> str:
        s, r = (urllib.parse.quote(str(x), safe="") for x in (self.session, round))  # the proxy checks both
        return f"{api_base(self.url)}/tokendance/sessions/{s}/rounds/{r}{tail}"

    def call(self, method: str, url: str, payload: Any = None) -> dict[str, Any]:
        return request(method, url, payload, self.api_key, self.timeout, self.retries)

    def announce(self, round: int, agents: list[str], timeout_ms: float | None = None) -> dict[str, Any]:
        """Name the agents of `round`: its barrier opens once all of them arrived
        (or `timeout_ms` after the first, when given)."""
        if isinstance(agents, str):  # list("alice") would expect five agents that never come
            raise TypeError(f"agents must be a list of names, not the string {agents!r}")
        body: dict[str, Any] = {"agents": list(agents)}
        if timeout_ms is not None:
            body["timeout_ms"] = timeout_ms
        return self.call("POST", self.path(round), body)

    def seal(self, round: int) -> dict[str, Any]:
        """Close `round` to newcomers and release whoever waits at its barrier."""
        return self.call("POST", self.path(round, "/seal"), {})

    def stats(self, round: int) -> dict[str, Any]:
        """The proxy's stats of `round`: groups, shared and reused tokens, KV held."""
        return self.call("GET", self.path(round))

    def chats(self, round: int, chats: dict[str, list[dict[str, Any]]], model: str | None = None,
              timeout: float = 600.0, **fields: Any) -> dict[str, str]:
        """Every agent's chat of `round` in one batch of chats (one group, no barrier);
        each agent's answer. `fields`: the chats' sampling (max_tokens, temperature, ...)."""
        if not chats:
            raise ValueError("chats must name at least one agent")
        body = {"model": model or served_model(self.url, self.api_key), "messages": list(chats.values()),
                **fields, "tokendance": {"session": self.session, "round": round, "agents": list(chats)}}
        out = request("POST", f"{api_base(self.url)}/chat/completions/batch", body, self.api_key, timeout,
                      self.retries)
        answers = sorted(out["choices"], key=lambda c: c["index"])
        return {agent: c["message"].get("content") or "" for agent, c in zip(chats, answers)}

    async def achats(self, round: int, chats: dict[str, list[dict[str, Any]]], model: str | None = None,
                     timeout: float = 600.0, **fields: Any) -> dict[str, str]:
        return await asyncio.to_thread(self.chats, round, chats, model, timeout, **fields)

    async def aannounce(self, round: int, agents: list[str], timeout_ms: float | None = None) -> dict[str, Any]:
        return await asyncio.to_thread(self.announce, round, agents, timeout_ms)

    async def aseal(self, round: int) -> dict[str, Any]:
        return await asyncio.to_thread(self.seal, round)

    async def astats(self, round: int) -> dict[str, Any]:
        return await asyncio.to_thread(self.stats, round)


def served_model(url: str | None = None, api_key: str = "tokendance", timeout: float = 10.0) -> str:
    """The id of the first model the proxy at `url` serves (requests must name it)."""
    models = request("GET", f"{api_base(url)}/models", None, api_key, timeout)
    return models["data"][0]["id"]


def request(method: str, url: str, payload: Any, api_key: str, timeout: float,
            retries: int = RETRIES) -> dict[str, Any]:
    """One JSON request, sent again as `backoff` says, `retries` times at most;
    ProxyError for an error answer, ConnectionError for no answer."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Authorization", f"Bearer {api_key}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for attempt in itertools.count():
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
            return json.loads(raw) if raw.strip() else {}
        except urllib.error.HTTPError as e:
            wait = backoff(e.code, e.headers, attempt)
            if wait is None or attempt >= retries:
                raise ProxyError(e.code, error_message(e.read())) from None
            e.close()
        except urllib.error.URLError as e:  # refused, unknown host, not an http(s) URL
            raise ConnectionError(f"cannot reach the TokenDance proxy at {url}: {e.reason}") from None
        time.sleep(wait)


def error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw)
        return str(err.get("error", {}).get("message") or err)
    except (ValueError, AttributeError):
        return raw.decode(errors="replace")[:200]
