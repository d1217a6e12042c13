"""Disconnects, engine failures, shutdown; /health and /metrics."""

import asyncio
import contextlib
import gc
import importlib.metadata
import json
import logging
import subprocess
import sys
import time
import weakref

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError

from tokendance.proxy.core import Config
from tokendance.proxy.listen import Listen
from tokendance.proxy.server import Server

MODEL = "fake-tiny"
LONG = " ".join(f"w{i}" for i in range(40))


def body(text: str, **more) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **more}


async def test_disconnect_mid_stream_aborts_and_frees(start, make_backend, until):
    be = make_backend(length=40, delay=0.02)
    server = await start(be, barrier_timeout=0.0)
    h = {"X-TokenDance-Session": "d", "X-TokenDance-Agent": "a"}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(server.url + "/v1/chat/completions", json=body(LONG, stream=True), headers=h)
        lines = []
        async for line in resp.content:
            if line.startswith(b"data: {"):
                lines.append(line)
            if len(lines) == 3:
                break
        resp.close()  # drop the connection mid-stream
    await until(lambda: be.aborted)
    assert be.active == set() and be.finished == set()
    await until(lambda: server.proxy.sessions.find("d", 1).view()["aborted"] == 1)
    assert "tokendance_aborted_total 1" in server.proxy.metrics.render()


@pytest.mark.parametrize("path, req", [
    ("/v1/chat/completions", body("a b c", stream=True)),
    ("/v1/completions", {"model": MODEL, "prompt": "a b c", "stream": True}),
    ("/v1/responses", {"model": MODEL, "input": "a b c", "stream": True}),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 8,
                      "stream": True})])
async def test_a_client_gone_before_its_stream_began_is_a_quiet_499(start, make_backend, monkeypatch, caplog,
                                                                   path, req):
    """The client went away while the request waited (at its barrier, say) and aiohttp had
    not noticed yet: the stream's headers find the connection closing. The request is
    counted as the client's (499), its engine work aborted, and nothing logs a traceback."""
    be = make_backend(length=8)
    server = await start(be)
    real = web.StreamResponse.prepare

    async def closing(self, request):
        if self.content_type == "text/event-stream":
            raise ClientConnectionResetError("Cannot write to closing transport")
        return await real(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", closing)
    async with aiohttp.ClientSession() as http:
        with contextlib.suppress(aiohttp.ClientError):  # a closing connection carries no answer
            async with http.post(server.url + path, json=req) as r:
                await r.read()
    assert be.aborted and be.finished == set()
    endpoint = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
                "/v1/messages": "messages"}[path]
    assert server.proxy.metrics.requests.values[(("code", "499"), ("endpoint", endpoint))] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_disconnect_while_generating_without_stream_aborts(start, make_backend, until):
    be = make_backend(length=40, delay=0.02)
    server = await start(be)
    async with aiohttp.ClientSession() as http:
        gone = asyncio.create_task(http.post(server.url + "/v1/chat/completions", json=body(LONG)))
        await until(lambda: be.active)
        gone.cancel()  # closes the connection while the engine generates
    await until(lambda: be.aborted)
    assert be.active == set() and be.finished == set()
    await until(lambda: server.proxy.in_flight == 0)


async def test_disconnect_at_the_barrier_leaves_the_group(start, make_backend, until):
    be = make_backend()
    server = await start(be, barrier_timeout=5.0)
    async with aiohttp.ClientSession() as http:
        await http.post(server.url + "/v1/tokendance/sessions/b/rounds/1", json={"agents": ["a", "b"]})
    ha, hb = ({"X-TokenDance-Session": "b", "X-TokenDance-Agent": x} for x in "ab")
    async with aiohttp.ClientSession() as http:
        gone = asyncio.create_task(http.post(server.url + "/v1/chat/completions", json=body("from a"),
                                             headers=ha))
        await until(lambda: server.proxy.barrier.waiting == 1)
        gone.cancel()
    await until(lambda: server.proxy.barrier.waiting == 0)
    async with aiohttp.ClientSession() as http:
        b = asyncio.create_task(http.post(server.url + "/v1/chat/completions", json=body("from b"),
                                          headers=hb))
        await until(lambda: server.proxy.barrier.waiting == 1)
        await asyncio.sleep(0.05)
        assert not b.done()  # a left, so b waits for a again
        a = await http.post(server.url + "/v1/chat/completions", json=body("from a again"), headers=ha)
        assert a.status == 200 and (await b).status == 200
    assert [[q.agent for q in g] for g in be.groups] == [["b", "a"]]


async def test_engine_failure_answers_every_request_of_the_group(start, make_backend):
    be = make_backend(fail="generate")
    server = await start(be, barrier_timeout=5.0)
    agents = ["a", "b", "c"]
    async with aiohttp.ClientSession() as http:
        await http.post(server.url + "/v1/tokendance/sessions/f/rounds/1", json={"agents": agents})

        async def one(a: str) -> tuple[int, dict]:
            async with http.post(server.url + "/v1/chat/completions", json=body(f"x {a}", stream=a == "c"),
                                 headers={"X-TokenDance-Session": "f", "X-TokenDance-Agent": a}) as r:
                return r.status, await r.json()

        results = await asyncio.gather(*map(one, agents))
    assert [(st, b["error"]["code"]) for st, b in results] == [(500, "engine_error")] * 3
    assert len(be.groups) == 1
    stats = server.proxy.sessions.find("f", 1).view()
    assert (stats["errors"], stats["requests"], stats["active"]) == (3, 3, 0)
    be.fail = None
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    r = await c.chat.completions.create(model=MODEL, messages=body("recovered")["messages"])
    assert r.choices[0].message.content == "recovered"
    await c.close()


async def test_engine_failure_mid_stream(start, make_backend):
    be = make_backend(fail="stream")
    server = await start(be)
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    msgs = body("a b c")["messages"]
    with pytest.raises(openai.APIError) as e:
        async for _ in await c.chat.completions.create(model=MODEL, messages=msgs, stream=True):
            pass
    assert "engine error" in str(e.value)
    with pytest.raises(openai.InternalServerError):
        await c.chat.completions.create(model=MODEL, messages=msgs)
    await c.close()
    assert 'tokendance_engine_errors_total 2' in server.proxy.metrics.render()


async def test_shutdown_drains_in_flight_requests(start, make_backend, until):
    be = make_backend(length=10, delay=0.02)
    server = await start(be, barrier_timeout=30.0)
    async with aiohttp.ClientSession() as http:
        await http.post(server.url + "/v1/tokendance/sessions/z/rounds/1", json={"agents": ["a", "b"]})

        async def one(h: dict, stream: bool) -> str:
            async with http.post(server.url + "/v1/chat/completions",
                                 json=body(LONG, stream=stream), headers=h) as r:
                assert r.status == 200
                return await r.text()

        held = asyncio.create_task(one({"X-TokenDance-Session": "z", "X-TokenDance-Agent": "a"}, False))
        running = asyncio.create_task(one({}, True))
        await until(lambda: server.proxy.in_flight == 2 and server.proxy.barrier.waiting == 1)
        assert not held.done() and not running.done()
        t0 = time.perf_counter()
        await server.stop()
        assert time.perf_counter() - t0 < 5.0  # the held one was released, not timed out
        choice = json.loads(await held)["choices"][0]
        assert choice["message"]["content"] == " ".join(LONG.split()[-10:])
        assert choice["finish_reason"] == "stop"
        assert (await running).endswith("data: [DONE]\n\n")
        assert be.closed and be.active == set()
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(server.url + "/health")


async def test_health_and_metrics(server):
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/health") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        server.proxy.backend.down = "the engine is gone"
        async with http.get(server.url + "/health") as r:  # what an orchestrator restarts on
            err = (await r.json())["error"]
            assert r.status == 503 and (err["message"], err["code"]) == ("the engine is gone", "backend_unavailable")
        server.proxy.backend.down = None
        await http.post(server.url + "/v1/chat/completions", json=body("count me"))
        await http.post(server.url + "/v1/chat/completions", json=body("x", max_tokens=0))
        async with http.get(server.url + "/metrics") as r:
            text = await r.text()
    assert r.content_type == "text/plain"
    assert 'tokendance_requests_total{code="200",endpoint="chat"} 1' in text
    assert 'tokendance_requests_total{code="400",endpoint="chat"} 1' in text
    assert 'tokendance_tokens_total{kind="completion"} 2' in text
    assert 'tokendance_groups_total{reason="bypass"} 1' in text
    assert "tokendance_barrier_wait_seconds_count 1" in text
    # the answered request's first token and the one after it (the 400 generated none)
    assert "tokendance_time_to_first_token_seconds_count 1" in text
    assert "tokendance_time_per_output_token_seconds_count 1" in text
    assert "tokendance_requests_in_flight 0" in text
    assert "# TYPE tokendance_engine_groups gauge\ntokendance_engine_groups 1" in text  # the backend's


async def test_ping_load_and_version_as_vllm_answers_them(start, make_backend, until):
    be = make_backend(length=40, delay=0.01)
    server = await start(be)
    async with aiohttp.ClientSession() as http:
        for method in (http.get, http.post):
            async with method(server.url + "/ping") as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"
        async with http.get(server.url + "/version") as r:
            assert (await r.json())["version"] == importlib.metadata.version("tokendance")
        running = asyncio.create_task(http.post(server.url + "/v1/chat/completions", json=body(LONG)))
        await until(lambda: be.active)
        async with http.get(server.url + "/load") as r:
            assert await r.json() == {"server_load": 1}
        (await running).release()
        async with http.get(server.url + "/load") as r:
            assert await r.json() == {"server_load": 0}
        be.down = "the engine is gone"
        async with http.post(server.url + "/ping") as r:
            assert r.status == 503


async def test_a_request_cut_off_while_generating_does_not_count_so_its_retry_keeps_the_round(
        start, make_backend, until):
    # The openai SDK retries a timed-out or 500 request: the retry must not skip a round.
    be = make_backend(length=40, delay=0.01)
    server = await start(be, barrier_timeout=0.0)
    h = {"X-TokenDance-Session": "retry", "X-TokenDance-Agent": "a"}
    async with aiohttp.ClientSession() as http:
        gone = asyncio.create_task(http.post(server.url + "/v1/chat/completions", json=body(LONG), headers=h))
        await until(lambda: be.active)
        gone.cancel()  # a client timeout while the engine generates
        await until(lambda: server.proxy.in_flight == 0)
        be.fail = "stream"
        async with http.post(server.url + "/v1/chat/completions", json=body(LONG), headers=h) as r:
            assert r.status == 500
        be.fail = None
        async with http.post(server.url + "/v1/chat/completions", json=body(LONG), headers=h) as r:
            assert r.status == 200 and r.headers["X-TokenDance-Round"] == "1"
        async with http.post(server.url + "/v1/chat/completions", json=body(LONG), headers=h) as r:
            assert r.headers["X-TokenDance-Round"] == "2"
    stats = server.proxy.sessions.find("retry", 1).view()
    assert (stats["aborted"], stats["errors"], stats["requests"]) == (1, 1, 3)
    assert list(server.proxy.sessions.find("retry", 1).outputs[""].producers) == [" ".join(LONG.split()[-40:])]


async def test_a_stopped_server_lets_its_backend_go(make_backend, broker, until):
    """aiohttp keeps every app that served a request for the process's life (its cache of
    middleware chains): a stopped server's backend, an engine's weights and KV, must not
    stay with it."""
    be = make_backend()
    gone = weakref.ref(be)
    server = Server(be, Config(), broker.url)
    await server.start(Listen(port=0))
    async with aiohttp.ClientSession() as http:  # a chat, and the conversations' routes
        async with http.post(server.url + "/v1/chat/completions", json=body("a b")) as r:
            assert r.status == 200
        async with http.post(server.url + "/v1/conversations", json={}) as r:
            assert r.status == 200
    await server.stop()
    del server, be
    await until(lambda: gc.collect() is not None and gone() is None)  # once the loop let the tasks go


async def test_health_is_a_503_once_the_engine_thread_stopped(start, tiny_llama):
    from tokendance.backend.service import EngineBackend

    be = EngineBackend.load(str(tiny_llama), dtype="float32", mode="full", offload_bytes=0)
    server = await start(be)
    async with aiohttp.ClientSession() as http:
        r = await http.post(server.url + "/v1/completions", json={"model": be.info.name, "prompt": "hi",
                                                                   "max_tokens": 1})
        assert r.status == 200
        async with http.get(server.url + "/health") as r:
            assert r.status == 200
        await be.core.close()
        async with http.get(server.url + "/health") as r:
            assert r.status == 503 and (await r.json())["error"]["message"] == "the engine has stopped"


@pytest.mark.parametrize("fleet", [False, True])
async def test_time_to_first_token_and_per_output_token(start, make_backend, fleet):
    """Also through a fleet, which holds a non-streamed answer's deltas until the last
    (backend/failover.py): its first token still counts from when it came."""
    from tokendance.backend.fleet import Fleet

    be = make_backend(length=5, delay=0.05)  # a token every 50 ms
    server = await start(Fleet([be]) if fleet else be)
    async with aiohttp.ClientSession() as http:
        for stream in (False, True):
            async with http.post(server.url + "/v1/chat/completions", json=body("a b c d e", stream=stream)) as r:
                await r.read()
    m = server.proxy.metrics
    assert (sum(m.ttft.counts), sum(m.tpot.counts)) == (2, 2)
    assert 2 * 0.05 <= m.ttft.sum <= m.latency.sum - 2 * 0.15  # the first after one delay, the last 4 later
    assert 2 * 0.04 <= m.tpot.sum <= 2 * 0.1  # 4 tokens after the first in ~4 x 50 ms


def test_a_checkout_that_is_not_installed_still_serves():
    """Without the distribution's metadata (a source checkout on the path, as the GPU host
    runs it) /version answers 0+source instead of the server failing to import."""
    code = ("import importlib.metadata as m\n"
            "def missing(name): raise m.PackageNotFoundError(name)\n"
            "m.version = missing\n"
            "from tokendance.proxy import app\n"
            "print(app.VERSION)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "0+source", out.stderr[-2000:]
