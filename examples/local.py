"""The proxy in this process, on a free loopback port, for `simulate` and the tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from tokendance.backend.api import Backend

PREFERRED = ("collective", "pic", "prefix", "full")  # best first


def backend(model: str | None, mode: str | None) -> Backend:
    """`echo` (no model), else the engine on `model` (None: the embedded default)."""
    if model == "echo":
        from tokendance.examples.echo import EchoBackend

        return EchoBackend(mode or PREFERRED[0])
    from tokendance.backend import service

    return service.EngineBackend.load(model, mode=mode or best(getattr(service, "AVAILABLE", PREFERRED)))


def best(available: tuple[str, ...]) -> str:
    return next(m for m in PREFERRED if m in available)


@asynccontextmanager
async def proxy(be: Backend, barrier_timeout: float = 5.0) -> AsyncIterator[str]:
    """Serve `be` on 127.0.0.1 at a free port; yields the base URL (ending in /v1)."""
    from tokendance.proxy.app import Server
    from tokendance.proxy.core import Config

    server = Server(be, Config(barrier_timeout=barrier_timeout))
    await server.start("127.0.0.1", 0)
    try:
        yield server.url + "/v1"
    finally:
        await server.stop()
