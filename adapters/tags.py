"""How a request tells the proxy who sent it: headers, or the body's `tokendance` field.

Every framework adapter builds on these two functions; they know nothing about any
framework. Values the caller leaves out are not sent (the proxy infers or defaults).
"""

from __future__ import annotations

from typing import Any

PREFIX = "X-TokenDance-"
DEFAULT_URL = "http://127.0.0.1:8000/v1"


def body(
    session: str | None = None,
    agent: str | None = None,
    round: int | None = None,
    mode: str | None = None,
) -> dict[str, Any]:
    """The request body's `tokendance` field, for clients that cannot add headers."""
    tags = {"session": session, "agent": agent, "round": round, "mode": mode}
    return {"tokendance": {k: v for k, v in tags.items() if v is not None}}


def headers(
    session: str | None = None,
    agent: str | None = None,
    round: int | None = None,
    mode: str | None = None,
) -> dict[str, str]:
    """The same tags as X-TokenDance-* headers."""
    tags = body(session, agent, round, mode)["tokendance"]
    return {PREFIX + k.capitalize(): str(v) for k, v in tags.items()}


def api_base(url: str | None) -> str:
    """`url` as an OpenAI base_url: with a trailing /v1, without a trailing slash."""
    url = (url or DEFAULT_URL).rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"
