"""The proxy in this process, on a free loopback port, for `simulate` and the tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from tokendance.backend.protocol import Backend
from tokendance.proxy.listen import Listen

PREFERRED = ("collective", "pic", "prefix", "full")  # best first


def backend(model: str | None, mode: str | None, **engine: Any) -> Backend:
    """`echo` (no model, no KV: `engine` options do not apply), else the engine on `model`
    (None: the embedded default) with `engine`'s EngineConfig fields."""
    if model == "echo":
        from tokendance.examples.echo import EchoBackend

        return EchoBackend(mode or PREFERRED[0])
    from tokendance.backend import service

    return service.EngineBackend.load(model, mode=mode or best(getattr(service, "AVAILABLE", PREFERRED)), **engine)


def best(available: tuple[str, ...]) -> str:
    return next(m for m in PREFERRED if m in available)


def server(be: Backend, barrier_timeout: float):  # -> tokendance.proxy.server.Server
    from tokendance.proxy.core import Config
    from tokendance.proxy.server import Server

    return Server(be, Config(barrier_timeout=barrier_timeout))


@asynccontextmanager
async def proxy(be: Backend, barrier_timeout: float = 5.0) -> AsyncIterator[str]:
    """Serve `be` on 127.0.0.1 at a free port; yields the base URL (ending in /v1)."""
    s = server(be, barrier_timeout)
    await s.start(Listen(port=0))
    try:
        yield s.url + "/v1"
    finally:
        await s.stop()


@contextmanager
def threaded(be: Backend, barrier_timeout: float = 5.0) -> Iterator[str]:
    """`proxy` on its own event loop in a daemon thread, for synchronous callers."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, name="tokendance-proxy", daemon=True)
    t.start()
    s = server(be, barrier_timeout)
    try:
        asyncio.run_coroutine_threadsafe(s.start(Listen(port=0)), loop).result(30)
        yield s.url + "/v1"
    finally:
        asyncio.run_coroutine_threadsafe(s.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.close()
