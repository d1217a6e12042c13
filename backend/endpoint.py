"""`tokendance engine`: the engine alone on a socket, for proxies elsewhere
(`tokendance serve --engine URL`; backend/remote.py is their side, backend/wire.py the
protocol). A group's answer streams as it is generated; a proxy that goes away, or
aborts a request, frees the KV of what it no longer reads."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog
from aiohttp import web

from tokendance.backend import config_file, heap, logs, wire
from tokendance.backend.api import Request
from tokendance.backend.auth import ENGINE_KEY_ENV, Keys, check_keys
from tokendance.backend.flags import add_engine_args, engine_options
from tokendance.backend.protocol import Backend, Stream

log = structlog.get_logger(__name__)
MAX_BODY = 256 * 2**20  # a group of long prompts


class Endpoint:
    def __init__(self, backend: Backend, info: wire.Info, keys: Keys | None = None):
        self.backend = backend
        self.info = wire.encoder.encode(info)
        self.keys = keys or Keys()  # required on the protocol's routes (/health stays open)
        self.live: dict[str, Stream] = {}  # request id -> its stream, while its group answers

    def app(self) -> web.Application:
        # The routes reach the endpoint through `held`, emptied at the app's cleanup: aiohttp
        # caches every app's middleware chain, handlers included, for the life of the process,
        # and a bound method would keep a stopped endpoint's engine, weights and KV with it.
        held = [self]

        def route(name: str) -> Callable[..., Awaitable[web.StreamResponse]]:
            async def call(*args: Any, **kw: Any) -> web.StreamResponse:
                if not held:
                    raise web.HTTPServiceUnavailable(text=wire.encoder.encode(wire.WireError(
                        "the engine has stopped")).decode(), content_type="application/json")
                return await getattr(held[0], name)(*args, **kw)
            return call

        async def forget(app: web.Application) -> None:
            held.clear()

        app = web.Application(client_max_size=MAX_BODY, middlewares=[web.middleware(route("_check_key"))])
        app.on_cleanup.append(forget)
        r, p = app.router, wire.PREFIX
        r.add_get(p + "/info", route("get_info"))
        r.add_post(p + "/generate", route("generate"))
        r.add_post(p + "/abort", route("abort"))
        r.add_get(p + "/gauges", route("gauges"))
        r.add_get("/health", route("health"))
        return app

    async def _check_key(self, req: web.Request, handler) -> web.StreamResponse:
        if self.keys and req.path.startswith(wire.PREFIX) and not self.keys.accept(req.headers):
            raise web.HTTPUnauthorized(text=wire.encoder.encode(wire.WireError(
                "this engine requires an API key (Authorization: Bearer ...)")).decode(),
                content_type="application/json")
        return await handler(req)

    async def get_info(self, req: web.Request) -> web.Response:
        return web.Response(body=self.info, content_type="application/json")

    async def health(self, req: web.Request) -> web.Response:
        problem = self.backend.problem()
        if problem is not None:
            return web.Response(status=503, body=wire.encoder.encode(wire.WireError(problem)),
                                content_type="application/json")
        return _json({"status": "ok", "live": len(self.live)})

    async def gauges(self, req: web.Request) -> web.Response:
        return web.Response(body=wire.encoder.encode(self.backend.gauges()), content_type="application/json")

    async def abort(self, req: web.Request) -> web.Response:
        body = _body(await req.read(), wire.Abort)
        for rid in body.ids:
            st = self.live.get(rid)
            if st is not None:
                st.abort()
        return _json({"aborted": len(body.ids)})

    async def generate(self, req: web.Request) -> web.StreamResponse:
        requests = _body(await req.read(), list[Request])
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids) or any(i in self.live for i in ids):
            raise _bad("request ids must be unique among the requests in flight")
        events: asyncio.Queue[wire.Event | None] = asyncio.Queue()
        streams = self._start(requests, events)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        pumps = [asyncio.create_task(_pump(i, st, events)) for i, st in streams.items()]
        try:
            await resp.prepare(req)
            left = len(pumps)
            while left or not events.empty():
                ev = await events.get()
                batch = [ev]
                while not events.empty():  # what came meanwhile goes out in one write
                    batch.append(events.get_nowait())
                left -= sum(e is None for e in batch)
                await resp.write(b"".join(wire.encoder.encode(e) + b"\n" for e in batch if e is not None))
            await resp.write_eof()
            return resp
        except ConnectionResetError:  # the proxy went away: nobody to answer, nothing to log
            return resp
        finally:  # also when the proxy went away: what it no longer reads stops
            for st in streams.values():
                st.abort()
            for t in pumps:
                t.cancel()
            for rid in ids:
                self.live.pop(rid, None)

    def _start(self, requests: list[Request], events: asyncio.Queue) -> dict[int, Stream]:
        """Prepare each request (one refused fails alone) and start the rest as one group."""
        prepared, index = [], []
        for i, r in enumerate(requests):
            try:
                prepared.append(self.backend.prepare(r))
                index.append(i)
            except Exception as e:
                events.put_nowait(wire.Event(i, failure=wire.failure(e)))
        if not prepared:
            return {}
        try:
            started = self.backend.generate(prepared)
        except Exception as e:
            log.exception("generate failed", size=len(prepared))
            for i in index:
                events.put_nowait(wire.Event(i, failure=wire.failure(e)))
            return {}
        streams = dict(zip(index, started))
        for i, st in streams.items():
            self.live[requests[i].id] = st
        return streams


async def _pump(i: int, st: Stream, events: asyncio.Queue) -> None:
    try:
        async for d in st:
            events.put_nowait(wire.Event(i, delta=d))
    except Exception as e:
        events.put_nowait(wire.Event(i, failure=wire.failure(e)))
    finally:
        events.put_nowait(None)


def _body(data: bytes, kind: Any) -> Any:
    try:
        return wire.decode(data, kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise _bad(f"invalid body: {e}") from e


def _bad(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=wire.encoder.encode(wire.WireError(message)).decode(),
                              content_type="application/json")


def _json(obj: Any) -> web.Response:
    return web.Response(body=wire.encoder.encode(obj), content_type="application/json")


def tokenizer_files(tokenizer: Any) -> dict[str, str]:
    """The tokenizer as the files save_pretrained writes (tokenizer.json, its config, the
    chat template): what a proxy needs to tokenize as this engine does."""
    with tempfile.TemporaryDirectory(prefix="tokendance-tok-") as d:
        tokenizer.save_pretrained(d)
        return {p.name: p.read_text(encoding="utf-8") for p in sorted(Path(d).iterdir()) if p.is_file()}


def engine_info(backend: Any) -> wire.Info:
    """What /info tells a proxy of an EngineBackend."""
    engine = backend.engine
    return wire.Info(name=engine.name, max_model_len=engine.max_model_len,
                     kv_bytes_per_token=engine.kv_bytes_per_token, vocab_size=engine.mcfg.vocab_size,
                     tokenizer=tokenizer_files(engine.tokenizer), sampling=backend.info.sampling,
                     priority=backend.info.priority, eos=list(backend.info.eos),
                     max_logprobs=backend.info.max_logprobs)


# -- `tokendance engine` --------------------------------------------------------------------

def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("engine", help="the engine alone, for `tokendance serve --engine URL`",
                              description=__doc__)
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish on shutdown")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"answer proxies only with this key (`tokendance serve --engine-api-key`); repeat "
                        f"it for several (default: ${ENGINE_KEY_ENV}, else none)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--uvicorn-log-level", default="info", choices=logs.HTTP_LEVELS,
                   help="the HTTP server's own log (vLLM's; its errors and faults, from this level on)")
    config_file.add_arg(p)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    logs.to_stderr(args.log_level)
    logs.http(args.uvicorn_log_level)
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must lie in 0..65535, got {args.port}")
    if not args.drain_timeout >= 0:
        raise ValueError("--drain-timeout must be a number, not negative")
    env = os.environ.get(ENGINE_KEY_ENV)
    given = check_keys(args.api_key, "--api-key") if args.api_key else check_keys([env] if env else [],
                                                                                  "$" + ENGINE_KEY_ENV)
    keys = Keys(given)
    options = engine_options(args)
    from tokendance.backend.service import EngineBackend

    backend = EngineBackend.load(**options)
    endpoint = Endpoint(backend, engine_info(backend), keys)
    with heap.frozen():
        asyncio.run(serve(endpoint, args.host, args.port, args.drain_timeout))
    return 0


async def serve(endpoint: Endpoint, host: str, port: int, drain_timeout: float = 30.0,
                stop: asyncio.Event | None = None, started: asyncio.Future | None = None,
                signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """Serve until one of `signals` (or `stop`); `started` gets the bound port."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(endpoint.app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=drain_timeout)
    try:
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        bound = runner.addresses[0][1]
        log.info("engine serving", host=host, port=bound)
        if started is not None:
            started.set_result(bound)
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await runner.cleanup()
        await endpoint.backend.close()
