"""The engine's endpoint alone (`tokendance engine`, backend/endpoint.py), as a proxy
speaks to it: bad bodies are 400s, and a proxy gone mid-group frees what it no longer
reads without a traceback."""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web

from tokendance.backend import wire
from tokendance.backend.api import Request, SamplingParams, Segment
from tests.proxy.test_remote import Remote, _serve, served


@pytest.fixture
async def engine(tiny_llama) -> AsyncIterator[Remote]:
    async with served(tiny_llama, offload_bytes=0) as e:
        yield e


async def test_the_endpoint_refuses_bad_bodies(engine):
    async with httpx.AsyncClient(base_url=engine.url + wire.PREFIX) as http:
        r = await http.post("/generate", content=b"[{")
        assert r.status_code == 400 and "invalid body" in r.json()["message"]
        r = await http.post("/generate", json=[{"id": 3}])
        assert r.status_code == 400 and "$[0].id" in r.json()["message"]
        one = wire.encoder.encode(Request("x", [Segment("hi")], SamplingParams(max_tokens=1)))
        r = await http.post("/generate", content=b"[" + one + b"," + one + b"]")
        assert r.status_code == 400 and "unique" in r.json()["message"]
        r = await http.post("/abort", json={"ids": "x"})
        assert r.status_code == 400
        spans = Request("y", [], SamplingParams(max_tokens=1), mode="pic", prompt_token_ids=[5, 6, 7],
                        shared_spans=[(2, 9)])
        r = await http.post("/generate", content=wire.encoder.encode([spans]))
        ev = wire.decode_event(r.content.strip())
        assert r.status_code == 200 and (ev.i, ev.failure.kind, ev.failure.param) == (0, "invalid", "shared")


async def test_a_proxy_gone_mid_group_frees_the_engines_kv_quietly(engine, monkeypatch, caplog, until):
    """The group's connection closes while the engine writes its answer (the proxy went
    away, or stopped): what it no longer reads stops, and nothing logs a traceback."""
    eng = engine.backend.engine
    free = eng.pool.num_free
    real = web.StreamResponse.write

    async def closing(self, data):
        if self.content_type == "application/x-ndjson" and eng.seqs:
            raise ConnectionResetError("Cannot write to closing transport")
        return await real(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", closing)
    one = Request("g", [], SamplingParams(max_tokens=500, ignore_eos=True), prompt_token_ids=[5, 6, 7])
    async with httpx.AsyncClient(base_url=engine.url + wire.PREFIX) as http:
        with contextlib.suppress(httpx.HTTPError):
            await http.post("/generate", content=wire.encoder.encode([one]))
    await until(lambda: not eng.seqs and eng.pool.num_free == free, timeout=10)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_stopped_endpoint_lets_its_engine_go(tiny_llama, until):
    """aiohttp keeps every app that served a request for the process's life (its cache of
    middleware chains): a stopped endpoint's engine, its weights and KV, must not stay."""
    r = await _serve(tiny_llama, offload_bytes=0)
    gone = weakref.ref(r.backend)
    one = Request("w", [], SamplingParams(max_tokens=2), prompt_token_ids=[5, 6, 7])
    async with httpx.AsyncClient(base_url=r.url + wire.PREFIX) as http:
        assert (await http.get("/info")).status_code == 200
        answer = await http.post("/generate", content=wire.encoder.encode([one]))
        assert answer.status_code == 200 and wire.decode_event(answer.content.splitlines()[-1]).i == 0
    app = r.runner.app
    await r.runner.cleanup()
    await r.backend.close()
    del r
    await until(lambda: gc.collect() is not None and gone() is None)
    info = next(x.handler for x in app.router.routes() if x.resource.canonical == wire.PREFIX + "/info")
    with pytest.raises(web.HTTPServiceUnavailable):  # a request in the moment it went away
        await info(None)
