"""Cross-origin requests (CORS), answered as vLLM answers them (its --allowed-origins,
--allowed-methods, --allowed-headers and --allow-credentials, through Starlette's
CORSMiddleware): by default any origin, method and header, so that a page in a browser
may call the API.

A preflight (OPTIONS with Access-Control-Request-Method) is answered here, before the
API key is asked for: browsers send none with it. Every other response from an allowed
origin, streamed ones included, gets its Access-Control-Allow-Origin header as it is
prepared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from aiohttp import web

from .errors import ApiError

METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")  # what "*" allows
SIMPLE = ("accept", "accept-language", "content-language", "content-type")  # always allowed
MAX_AGE = 600  # seconds a browser may keep a preflight's answer


@dataclass(frozen=True)
class Cors:
    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def allows(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    def allow_origin(self, origin: str) -> dict[str, str]:
        """The headers any answer to `origin` carries (none for an origin not allowed).
        With credentials, or origins named, the origin is echoed: a browser refuses "*"
        for a credentialed request, and a cache must tell origins apart."""
        if not self.allows(origin):
            return {}
        if "*" in self.origins and not self.credentials:
            return {"Access-Control-Allow-Origin": "*"}
        out = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.credentials:
            out["Access-Control-Allow-Credentials"] = "true"
        return out

    def preflight(self, origin: str, method: str, requested: str) -> dict[str, str]:
        """The preflight's own headers (ApiError 400 naming what is not allowed)."""
        asked = [h.strip().lower() for h in requested.split(",") if h.strip()]
        named = {*SIMPLE, *(h.lower() for h in self.headers)} - {"*"}
        refused = [what for what, ok in (
            ("origin", self.allows(origin)),
            ("method", "*" in self.methods or method.upper() in {m.upper() for m in self.methods}),
            ("headers", "*" in self.headers or set(asked) <= named),
        ) if not ok]
        if refused:
            raise ApiError(400, f"Disallowed CORS {', '.join(refused)}: {origin} asked {method} with "
                                f"headers [{requested}]", param="Origin")
        allowed = requested if "*" in self.headers and requested else ", ".join(sorted(named))
        return {"Access-Control-Allow-Methods": ", ".join(METHODS if "*" in self.methods else self.methods),
                "Access-Control-Allow-Headers": allowed, "Access-Control-Max-Age": str(MAX_AGE)}


def parse(flag: str, given: str) -> tuple[str, ...]:
    """A JSON list of strings from a flag (ValueError naming the flag)."""
    try:
        value = json.loads(given)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{flag}: expected a JSON list of strings, such as '[\"*\"]', got {given!r}")
    return tuple(value)


def preflights(cors: Cors):
    """The middleware answering preflights (outside the API key's: browsers send none
    with one; inside the error middleware's, which shapes a refusal)."""

    @web.middleware
    async def preflight(request: web.Request, handler) -> web.StreamResponse:
        method, origin = request.headers.get("Access-Control-Request-Method"), request.headers.get("Origin")
        if request.method != "OPTIONS" or method is None or origin is None:
            return await handler(request)
        asked = request.headers.get("Access-Control-Request-Headers", "")
        return web.Response(text="OK", headers=cors.preflight(origin, method, asked))

    return preflight


def answer(app: web.Application, cors: Cors) -> None:
    """Every response of `app` to an allowed origin gets its headers as it is prepared."""

    async def prepared(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None:
            response.headers.update(cors.allow_origin(origin))

    app.on_response_prepare.append(prepared)
