"""How a request tells the proxy who sent it (headers, or the body's `tokendance`
field) and, optionally, which blocks of its prompt are shared.

Every framework adapter builds on these functions; they know nothing about any
framework. Values the caller leaves out are not sent (the proxy infers or defaults).
"""

from __future__ import annotations

from typing import Any

from tokendance.proxy.segment import SEP, escape

PREFIX = "X-TokenDance-"
DEFAULT_URL = "http://127.0.0.1:8000/v1"


def body(
    session: str | None = None,
    agent: str | None = None,
    round: int | None = None,
    mode: str | None = None,
    separators: bool | None = None,
    agents: list[str] | None = None,
) -> dict[str, Any]:
    """The request body's `tokendance` field, for clients that cannot add headers.
    `agents`: a batch of chats' conversations' agents, in order."""
    tags = {"session": session, "agent": agent, "round": round, "mode": mode, "separators": separators,
            "agents": agents}
    return {"tokendance": {k: v for k, v in tags.items() if v is not None}}


def headers(
    session: str | None = None,
    agent: str | None = None,
    round: int | None = None,
    mode: str | None = None,
    separators: bool | None = None,
    agents: list[str] | None = None,
) -> dict[str, str]:
    """The same tags as X-TokenDance-* headers (agents comma-separated)."""
    tags = body(session, agent, round, mode, separators, agents)["tokendance"]
    out = {PREFIX + k.capitalize(): str(v).lower() if isinstance(v, bool) else ",".join(v) if isinstance(v, list)
           else str(v) for k, v in tags.items()}
    for k, v in out.items():  # httpx raises deep inside a request for these (or drops the connection)
        if not (v.isascii() and v.isprintable()):
            raise ValueError(f"{k} {v!r}: HTTP headers carry printable ASCII only; "
                             "send the tags in the request body instead (tags.body)")
    return out


def shared(*blocks: str) -> str:
    """Message text made of blocks the proxy should treat as shared across agents.

    Needs separators switched on for the request (`separators=True` above); without,
    the proxy still finds its own earlier outputs in a prompt by itself."""
    for b in blocks:
        if not isinstance(b, str):
            raise TypeError(f"shared() takes str blocks, got {type(b).__name__}")
    return SEP + SEP.join(escape(b) for b in blocks) + SEP


def api_base(url: str | None) -> str:
    """`url` as an OpenAI base_url: with a trailing /v1, without a trailing slash."""
    url = (url or DEFAULT_URL).rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"
