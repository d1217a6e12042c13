"""API keys, as vLLM's `--api-key`: a server given keys answers only requests that
carry one of them (`Authorization: Bearer KEY`), and a client sends its key the same
way. The proxy's /v1 routes (proxy/errors.py) and the remote engine's
(backend/endpoint.py) check them; the proxy's clients of a remote engine or a vLLM
server send one (`tokendance serve --engine-api-key`)."""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping

ENGINE_KEY_ENV = "TOKENDANCE_ENGINE_API_KEY"  # the engine's keys, and what the proxy sends it


def bearer(headers: Mapping[str, str]) -> str:
    """The key a request carries ("" if none): `Authorization: Bearer`, or the
    `x-api-key` that Anthropic's SDK sends."""
    given = headers.get("Authorization", "").removeprefix("Bearer ").strip()
    return given or headers.get("x-api-key", "").strip()


def header(key: str | None) -> dict[str, str]:
    """The headers that carry `key` (none without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def refused(url: str, key: str | None) -> str:
    """What to tell the user when the server at `url` answered 401."""
    if key:
        return f"the server at {url} refused the API key given (--engine-api-key)"
    return f"the server at {url} requires an API key: give it with --engine-api-key"


class Keys:
    def __init__(self, accepted: Iterable[str] = ()):
        self._wanted = [k.encode() for k in accepted]

    def __bool__(self) -> bool:
        return bool(self._wanted)

    def accept(self, headers: Mapping[str, str]) -> bool:
        """Whether the request carries one of the keys (in constant time for each)."""
        given = bearer(headers).encode()
        return any(hmac.compare_digest(given, k) for k in self._wanted)


def check_keys(keys: Iterable[str], flag: str) -> list[str]:
    """Keys from a command line; a ValueError (one line for the user) if one cannot be sent."""
    keys = list(keys)
    if any(not k.strip() or any(c.isspace() for c in k) for k in keys):
        raise ValueError(f"{flag}: a key is a non-empty string without whitespace")
    return keys
