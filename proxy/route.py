"""What every route handler shares: the proxy in the app, the request's clock, the
count of requests in flight and by status code, JSON answers."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from tokendance.backend.api import InvalidRequest

from .core import Proxy
from .errors import ApiError

PROXY = web.AppKey("proxy", Proxy)
T0 = web.RequestKey("t0", float)  # perf_counter once the request body was received
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def tracked(endpoint: str) -> Callable[[Handler], Handler]:
    """Count the request in flight (shutdown drains them) and by status code."""
    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def run(req: web.Request) -> web.StreamResponse:
            px = req.app[PROXY]
            px.enter()
            code = "500"
            try:
                await req.read()  # cached for the handler; the clock starts once the body is here
                req[T0] = time.perf_counter()
                resp = await handler(req)
                code = str(resp.status)
                return resp
            except (ApiError, web.HTTPException) as exc:
                code = str(exc.status)
                raise
            except InvalidRequest:  # e.g. from render_chat; the middleware answers 400
                code = "400"
                raise
            except (asyncio.CancelledError, ConnectionResetError):  # the client went away
                code = "499"
                raise
            finally:
                px.leave()
                px.metrics.requests.inc(endpoint=endpoint, code=code)
        return run
    return wrap


def json_answer(obj: object, id: str | None = None) -> web.Response:
    """`obj` as JSON; `id`: the answer's id, which vLLM repeats as X-Request-Id."""
    resp = web.Response(body=msgspec.json.encode(obj), content_type="application/json")
    if id is not None:
        resp.headers["X-Request-Id"] = id
    return resp
