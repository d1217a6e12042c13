"""The proxy over a remote engine it cannot reach: a 503 `backend_unavailable` with
Retry-After when nothing of a request ran there (so a client may send it again and get
its answer once the engine is back), a 500 `engine_error` when the engine was lost
partway through an answer; never a hang. The same for a vLLM server: test_vllm.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from tokendance.backend import wire
from tokendance.backend.api import BackendError, Delta, Prepared, Unavailable
from tokendance.backend.endpoint import Endpoint, engine_info
from tokendance.backend.remote import RemoteBackend
from tests.proxy.fake_backend import FakeBackend
from tests.proxy.test_remote import _client, served, user


@pytest.fixture
async def remote(tiny_llama):
    async with served(tiny_llama, offload_bytes=0) as r:
        yield r


@pytest.fixture
async def proxy(remote, start) -> Any:
    return await start(await RemoteBackend.connect(remote.url, "collective"), barrier_timeout=10.0)


async def test_an_engine_that_cannot_be_reached_is_a_503_at_once(proxy, remote, until):
    c = _client(proxy)
    name = proxy.proxy.backend.info.name
    await remote.runner.cleanup()
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        await until(lambda: proxy.proxy.backend.problem() is not None, timeout=10)  # the 2 s poll
        health = await http.get("/health")
    assert health.status_code == 503 and "does not answer" in health.json()["error"]["message"]
    t0 = time.perf_counter()
    with pytest.raises(openai.InternalServerError) as e:
        await c.chat.completions.create(model=name, messages=user("hi"), max_tokens=2)
    assert time.perf_counter() - t0 < 5
    # nothing ran: a 503 that says when to ask again (the openai SDK waits that long)
    assert e.value.status_code == 503 and e.value.response.headers["Retry-After"] == "2"
    assert e.value.body["code"] == "backend_unavailable"
    assert e.value.body["message"].startswith(f"engine unavailable: cannot reach the engine at {remote.url}")
    with pytest.raises(openai.InternalServerError) as e:  # streamed: the same, before the stream starts
        await c.chat.completions.create(model=name, messages=user("hi"), max_tokens=2, stream=True)
    assert e.value.status_code == 503 and e.value.response.headers["Retry-After"] == "2"


async def test_a_client_that_retries_gets_its_answer_once_the_engine_is_back(proxy, remote, until):
    name = proxy.proxy.backend.info.name
    port = int(remote.url.rsplit(":", 1)[1])
    await remote.runner.cleanup()
    retrying = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=2)
    call = asyncio.ensure_future(retrying.chat.completions.create(model=name, messages=user("hi"), max_tokens=2))
    await until(lambda: proxy.proxy.metrics.engine_errors.values.get((), 0) == 1, timeout=10)  # its first try: a 503
    failed = time.perf_counter()
    back = web.AppRunner(Endpoint(remote.backend, engine_info(remote.backend)).app())
    await back.setup()
    await web.TCPSite(back, "127.0.0.1", port).start()
    try:
        answer = await asyncio.wait_for(call, 30)  # its next, Retry-After later
        assert answer.choices[0].finish_reason == "length"
        assert time.perf_counter() - failed > 1.5  # the SDK's own first wait is 0.5 s at most
        assert proxy.proxy.metrics.engine_errors.values.get((), 0) == 1
    finally:
        await back.cleanup()


async def test_an_engine_that_answers_it_cannot_serve_is_a_503_and_down_at_once(proxy, remote, monkeypatch):
    async def stopping(self, req: web.Request) -> web.Response:
        return web.Response(status=503, body=wire.encoder.encode(wire.WireError("the engine has stopped")))

    monkeypatch.setattr(Endpoint, "generate", stopping)
    with pytest.raises(openai.InternalServerError) as e:
        await _client(proxy).chat.completions.create(model=proxy.proxy.backend.info.name,
                                                     messages=user("hi"), max_tokens=2)
    assert e.value.status_code == 503 and e.value.body["code"] == "backend_unavailable"
    assert e.value.body["message"] == f"engine unavailable: the engine at {remote.url} cannot serve now: " \
                                      "the engine has stopped"
    assert proxy.proxy.backend.problem() is not None  # before any poll could have seen it


async def test_an_engine_lost_partway_through_an_answer_is_a_500(proxy, remote, monkeypatch):
    async def broken(self, req: web.Request) -> web.StreamResponse:
        out = web.StreamResponse()
        await out.prepare(req)
        req.transport.close()  # the engine's process died mid-answer
        return out

    monkeypatch.setattr(Endpoint, "generate", broken)
    with pytest.raises(openai.InternalServerError) as e:
        await _client(proxy).chat.completions.create(model=proxy.proxy.backend.info.name,
                                                     messages=user("hi"), max_tokens=2)
    assert e.value.status_code == 500 and e.value.body["code"] == "engine_error"
    assert f"lost the engine at {remote.url}" in e.value.body["message"]


class Restarting(FakeBackend):
    """An engine that cannot take the first `down` groups it is given (`why`: Unavailable,
    a 503, or another BackendError, a 500) and serves the rest."""

    def __init__(self, why: BackendError, down: int = 1) -> None:
        super().__init__()
        self.why, self.down = why, down

    def generate(self, group: list[Prepared]) -> list[Any]:
        if self.down == 0:
            return super().generate(group)
        self.down -= 1
        self.groups.append([p.request for p in group])
        return [Refused(self.why) for _ in group]


class Refused:
    def __init__(self, why: BackendError) -> None:
        self.why = why

    async def __aiter__(self) -> AsyncIterator[Delta]:
        raise self.why
        yield

    def abort(self) -> None:
        pass


@pytest.mark.parametrize("why", [Unavailable("cannot reach the engine", 0.01), BackendError("lost the engine")])
async def test_a_group_whose_requests_failed_is_one_group_again_when_they_are_sent_again(start, why):
    be = Restarting(why)
    server = await start(be, barrier_timeout=5.0)
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=1)

    async def turn(agent: str) -> Any:
        return await c.chat.completions.create(
            model="fake-tiny", messages=user(f"I am {agent}."), max_tokens=2,
            extra_body={"tokendance": {"session": "s", "agent": agent, "round": 1}})

    async with httpx.AsyncClient(base_url=server.url) as http:
        await http.post("/v1/tokendance/sessions/s/rounds/1", json={"agents": ["a", "b", "c"]})
        t0 = time.perf_counter()
        rs = await asyncio.gather(*map(turn, "abc"))
        assert [r.choices[0].message.content for r in rs] == ["I am "] * 3
        # the retries, 1 s (the Retry-After) or the SDK's backoff (0.375 to 0.5 s) later:
        # the first back waits for the others, and they go together
        assert [len(g) for g in be.groups] == [3, 3] and time.perf_counter() - t0 < 4
        stats = (await http.get("/v1/tokendance/sessions/s/rounds/1")).json()
    # the failed tries count as requests and errors, their tokens not at all
    assert (stats["requests"], stats["errors"]) == (6, 3)
    assert stats["prompt_tokens"] == sum(r.usage.prompt_tokens for r in rs)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": user("hi"), "max_tokens": 2}),
    ("/v1/completions", {"prompt": "a b c", "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/v1/messages", {"messages": user("hi"), "max_tokens": 2}),
])
async def test_a_stream_its_engine_could_not_start_is_an_http_503_not_an_event(start, path, body):
    server = await start(Restarting(Unavailable("cannot reach the engine", 0.01)))
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": "Bearer sk-test"}) as http:
        r = await http.post(path, json={"model": "fake-tiny", "stream": True, **body})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1" and "cannot reach the engine" in r.text
        r = await http.post(path, json={"model": "fake-tiny", "stream": True, **body})  # its retry
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    assert "cannot reach" not in r.text


async def test_a_group_refused_at_once_tells_each_of_its_requests_when_to_come_back(start):
    class Refuses(FakeBackend):
        def generate(self, group: list[Prepared]) -> list[Any]:
            raise Unavailable("cannot reach the engine", 2.0)

    server = await start(Refuses(), barrier_timeout=5.0)
    async with httpx.AsyncClient(base_url=server.url) as http:
        await http.post("/v1/tokendance/sessions/s/rounds/1", json={"agents": ["a", "b"]})
        rs = await asyncio.gather(*[http.post("/v1/chat/completions", json={
            "model": "fake-tiny", "messages": user("hi"), "max_tokens": 2,
            "tokendance": {"session": "s", "agent": a, "round": 1}}) for a in "ab"])
    assert [(r.status_code, r.headers.get("Retry-After")) for r in rs] == [(503, "2")] * 2


class Broken:
    """A stream whose engine is lost after its first token."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    async def __aiter__(self) -> AsyncIterator[Delta]:
        async for d in self.stream:
            yield d
            raise BackendError("lost the engine")

    def abort(self) -> None:
        self.stream.abort()


async def test_a_stream_lost_after_it_opened_is_not_awaited_again(start):
    """Its client learns of it in the stream and does not send it again, so the retry of
    another agent of its group goes at once, not after the barrier's timeout."""
    class Breaks(FakeBackend):
        def generate(self, group: list[Prepared]) -> list[Any]:
            streams = super().generate(group)
            if len(self.groups) > 1:
                return streams
            return [Broken(s) if p.request.agent == "a" else Refused(Unavailable("cannot reach the engine", 0.01))
                    for p, s in zip(group, streams)]

    be = Breaks()
    server = await start(be, barrier_timeout=3.0)
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=1)
    tags = lambda agent: {"tokendance": {"session": "s", "agent": agent, "round": 1}}  # noqa: E731

    async def streamed() -> str:
        got = ""
        with pytest.raises(openai.APIError, match="lost the engine"):
            async for chunk in await c.chat.completions.create(
                    model="fake-tiny", messages=user("I am a."), max_tokens=4, stream=True, extra_body=tags("a")):
                got += chunk.choices[0].delta.content or "" if chunk.choices else ""
        return got

    async def retried() -> tuple[str, float]:
        t0 = time.perf_counter()
        r = await c.chat.completions.create(model="fake-tiny", messages=user("I am b."), max_tokens=2,
                                            extra_body=tags("b"))
        return r.choices[0].message.content, time.perf_counter() - t0

    async with httpx.AsyncClient(base_url=server.url) as http:
        await http.post("/v1/tokendance/sessions/s/rounds/1", json={"agents": ["a", "b"]})
        got, (answer, took) = await asyncio.gather(streamed(), retried())
    assert got == "I " and answer == "I am "
    # b is sent again after its Retry-After (1 s) and goes alone, without waiting for a
    assert [len(g) for g in be.groups] == [2, 1] and took < 2.5, took
