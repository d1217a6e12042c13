"""How the HTTP backends (remote.py, vllm.py) report an engine they could not reach:
a call that never got through ran nothing, so its requests may be sent again (the
proxy's 503); one lost partway is an engine failure (`Lost`: a 500, unless a fleet
sends the requests that showed their clients nothing to another engine)."""

from __future__ import annotations

import aiohttp

from tokendance.backend.api import BackendError, Lost, Unavailable

NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)  # refused, no route, connect timed out


def lost(what: str, e: BaseException, poll: float) -> BackendError:
    """`e`, raised by a call to `what` ("the engine at URL"), as its requests' error;
    `poll`: seconds between the backend's looks at the engine's health."""
    why = f"{e or type(e).__name__}"
    if isinstance(e, NOT_SENT):
        return Unavailable(f"cannot reach {what}: {why}", poll)
    return Lost(f"lost {what}: {why}")


def answered(what: str, status: int, message: str, poll: float) -> BackendError:
    """An HTTP answer other than 200 (and a client's 4xx) from `what`: a 503 says it
    cannot serve now, anything else that it failed."""
    if status == 503:
        return Unavailable(f"{what} cannot serve now: {message}", poll)
    return BackendError(f"{what} answered HTTP {status}: {message}")
