"""A fleet sends what an engine could not take, or was lost while running, to another
engine before its client sees an error (backend/failover.py): a group's share moves
whole, a request that has streamed stays, one read whole moves even partway, and with
no other engine serving the client gets the error."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from tokendance.backend.api import Delta, Lost, Prepared, Unavailable
from tokendance.backend.fleet import Fleet, Pin
from tokendance.backend.remote import RemoteBackend
from tokendance.backend.vllm import VLLMBackend
from tests.proxy.fake_backend import FakeBackend
from tests.proxy.fake_vllm import FakeVLLM, client
from tests.proxy.fake_vllm import served as served_vllm
from tests.proxy.test_fleet import request
from tests.proxy.test_remote import served


class Refusing(FakeBackend):
    """An engine that ran nothing of what it was given (`after` deltas streamed first)
    and reports itself down, as RemoteBackend does when it cannot reach its engine."""

    def __init__(self, after: int = 0) -> None:
        super().__init__()
        self.after = after

    def error(self) -> Exception:
        return Unavailable("cannot reach the engine", 2.0)

    def generate(self, group: list[Prepared]) -> list[Any]:
        self.groups.append([p.request for p in group])
        self.down = "cannot reach the engine"
        return [Refused(self, p.request.id) for p in group]


class Refused:
    def __init__(self, backend: Refusing, rid: str) -> None:
        self.backend, self.rid = backend, rid

    async def __aiter__(self) -> AsyncIterator[Delta]:
        for _ in range(self.backend.after):
            yield Delta("early ", [1])
        raise self.backend.error()

    def abort(self) -> None:
        self.backend.aborted.add(self.rid)


class Lose(Refusing):
    """An engine lost while it ran its group: `after` deltas each, then the connection broke."""

    def error(self) -> Exception:
        return Lost("lost the engine: connection reset")


async def texts(streams: list[Any]) -> list[str]:
    async def one(st: Any) -> str:
        return "".join([d.text async for d in st])
    return await asyncio.gather(*map(one, streams))


def pinned(engines: list[Any], session: str = "s", ids: str = "abc") -> tuple[Fleet, list[Prepared]]:
    f = Fleet(engines)
    f.pins["", session] = Pin(0, 0.0)
    return f, [f.prepare(request(i, session)) for i in ids]


async def test_a_group_its_engine_could_not_take_moves_whole_to_another():
    engines = [Refusing(), FakeBackend(), FakeBackend()]
    f, group = pinned(engines)
    got = await texts(f.generate(group))
    assert got == ["hello from "] * 3  # two words of each prompt, echoed
    served_by = [e for e in engines[1:] if e.groups]
    assert len(served_by) == 1 and [[r.id for r in g] for g in served_by[0].groups] == [["a", "b", "c"]]
    assert f.pins["", "s"].engine == engines.index(served_by[0])
    assert not served_by[0].active and not served_by[0].aborted  # each finished there
    assert f.resent == 3 and [g.value for g in f.gauges() if g.name == "fleet_resent_total"] == [3]


async def test_a_request_that_has_streamed_is_not_sent_again():
    engines = [Refusing(after=1), FakeBackend()]
    f, group = pinned(engines, ids="a")
    (st,) = f.generate(group)
    seen = []
    with pytest.raises(Unavailable):
        async for d in st:
            seen.append(d.text)
    assert seen == ["early "] and not engines[1].groups


def whole(f: Fleet, rid: str, session: str = "s") -> Prepared:
    r = request(rid, session)
    r.whole = True
    return f.prepare(r)


async def test_an_engine_lost_partway_hands_on_what_showed_its_client_nothing():
    """Of a group whose engine was lost after two deltas each: a request read whole (its
    deltas held) starts again on the other engine, its client sees that engine's answer
    only; a streamed one that had streamed gets the error; one the engine had sent
    nothing yet moves too."""
    engines = [Lose(after=2), FakeBackend()]
    f = Fleet(engines)
    f.pins["", "s"] = Pin(0, 0.0)
    group = [whole(f, "a"), f.prepare(request("b", "s"))]
    a, b = f.generate(group)
    seen_b = []
    with pytest.raises(Lost, match="connection reset"):
        async for d in b:
            seen_b.append(d.text)
    assert seen_b == ["early ", "early "]
    assert [d.text async for d in a] == ["hello ", "from "]  # the other engine's, whole
    assert [[r.id for r in g] for g in engines[1].groups] == [["a"]] and f.resent == 1
    engines[0].after = 0  # lost before it sent anything: a streamed request moves as well
    f.pins["", "s2"] = Pin(0, 0.0)
    engines[0].down = None
    (c,) = f.generate([f.prepare(request("c", "s2"))])
    assert [d.text async for d in c] == ["hello ", "from "] and engines[1].groups[-1][0].id == "c"


async def test_a_whole_request_shows_its_deltas_once_its_engine_sent_the_last():
    """Held, each delta keeps when it came: time-to-first-token counts from there."""
    engines = [FakeBackend(delay=0.05)]
    f = Fleet(engines)
    (st,) = f.generate([whole(f, "a", session=None)])
    it = aiter(st)
    first = await anext(it)
    shown = time.perf_counter()
    assert engines[0].groups and not engines[0].active  # the engine was done before the first showed
    assert first.at is not None and shown - first.at >= 0.04  # it came a delta's delay before the last
    assert "".join([first.text] + [d.text async for d in it]) == "hello from "


@pytest.mark.parametrize("n", [2, 3])
async def test_with_no_other_engine_to_take_it_the_client_gets_the_error(n):
    engines = [Refusing() for _ in range(n)]
    f, group = pinned(engines)
    for st in f.generate(group):
        with pytest.raises(Unavailable, match="cannot reach"):
            [d async for d in st]
    assert [len(e.groups) for e in engines] == [1] * n  # each tried once, none twice


async def test_a_client_that_leaves_after_its_request_moved_stops_it_where_it_went():
    engines = [Refusing(), FakeBackend(delay=0.05)]
    f, group = pinned(engines, ids="ab")
    a, b = f.generate(group)
    it = aiter(a)
    first = await anext(it)  # a's error moved both
    assert first.text == "hello " and [r.id for r in engines[1].groups[0]] == ["a", "b"]
    b.abort()  # b's consumer never read, and leaves
    assert "b" in engines[1].aborted and "b" in engines[0].aborted
    assert "".join([first.text] + [d.text async for d in it]) == "hello from "
    assert "a" not in engines[1].aborted


# -- real engines, through the proxy ---------------------------------------------------------


@pytest.fixture
async def pair(tiny_llama) -> Any:
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(served(tiny_llama, offload_bytes=0)) for _ in range(2)]
        yield [(e.url, e.runner) for e in engines]


async def test_a_round_whose_engine_went_away_is_answered_by_the_other_without_a_retry(pair, start):
    fleet = await Fleet.connect([u for u, _ in pair], lambda u: RemoteBackend.connect(u, "collective"))
    server = await start(fleet, barrier_timeout=10.0)
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)

    async def turn(agent: str, rnd: int) -> str:
        r = await c.chat.completions.create(
            model=fleet.info.name, messages=[{"role": "user", "content": f"I am {agent}. Tell me about rivers."}],
            max_tokens=4, temperature=0,
            extra_body={"tokendance": {"session": "s", "agent": agent, "round": rnd}})
        return r.choices[0].message.content

    async with httpx.AsyncClient(base_url=server.url) as http:
        await http.post("/v1/tokendance/sessions/s/rounds/1", json={"agents": ["a", "b", "c"]})
        first = await asyncio.gather(*[turn(a, 1) for a in "abc"])
        (pin,) = fleet.pins.values()
        was = pin.engine
        await pair[was][1].cleanup()  # that engine's socket closes before the proxy's poll sees it
        await http.post("/v1/tokendance/sessions/s/rounds/2", json={"agents": ["a", "b", "c"]})
        second = await asyncio.gather(*[turn(a, 2) for a in "abc"])  # no client retries
        stats = (await http.get("/v1/tokendance/sessions/s/rounds/2")).json()
    assert pin.engine == 1 - was and second == first
    assert (stats["groups"], stats["requests"]) == (1, 3)  # still one group, on the other engine


async def test_an_engine_lost_mid_answer_is_replaced_before_the_client_sees_it(tiny_llama, start):
    """A non-streamed chat in a session, its engine's connection broken after the engine
    has generated some of it: the proxy answers from the other engine, the same tokens as
    an engine that was never lost, with no retry by the client (that was a 500)."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(served(tiny_llama, offload_bytes=0)) for _ in range(2)]
        fleet = await Fleet.connect([e.url for e in engines], lambda u: RemoteBackend.connect(u, "collective"))
        server = await start(fleet)
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)
        kw = dict(model=fleet.info.name, messages=[{"role": "user", "content": "Tell me about rivers."}],
                  max_tokens=400, temperature=0, extra_body={"ignore_eos": True})
        alone = await c.chat.completions.create(**kw)  # outside any session: engines in turn
        task = asyncio.create_task(c.chat.completions.create(
            **{**kw, "extra_body": {"ignore_eos": True, "tokendance": {"session": "s", "agent": "a"}}}))
        while not fleet.pins:
            await asyncio.sleep(0.001)
        (pin,) = fleet.pins.values()
        was = engines[pin.engine]
        while not task.done() and not any(len(q.out) >= 20 for q in list(was.backend.engine.seqs.values())):
            await asyncio.sleep(0.001)  # partway
        assert not task.done(), "the answer ended before the engine could be lost partway"
        for h in was.runner.server.connections:  # the proxy's connection breaks mid-answer
            h.transport.abort()
        got = await task
    assert pin.engine == 1 - engines.index(was) and fleet.resent == 1
    assert got.choices[0].message.content == alone.choices[0].message.content
    assert got.usage.completion_tokens == 400


async def test_a_vllm_server_that_answers_503_hands_its_requests_to_another(tiny_llama, start):
    fakes = [await served_vllm(FakeVLLM(str(tiny_llama))) for _ in range(2)]
    try:
        fleet = await Fleet.connect([f.url for f in fakes], lambda u: VLLMBackend.connect(u))
        server = await start(fleet)
        fakes[0].status = 503  # where a new session goes first
        r = await client(server).completions.create(model="fake-vllm", prompt="a b", max_tokens=2,
                                       extra_body={"tokendance": {"session": "s", "agent": "a"}})
        assert r.choices[0].text == " w0 w1" and len(fakes[1].bodies) == 1
        assert fleet.engines[0].problem() is not None  # it takes nothing more until its /health answers
    finally:
        for f in fakes:
            await f.runner.cleanup()


@pytest.mark.parametrize("how", ["reset", "end"])
async def test_a_vllm_server_lost_mid_answer_hands_on_a_whole_request(tiny_llama, start, how):
    """A vLLM server whose stream breaks after two tokens (the connection reset, or the
    stream ended with no finish): a non-streamed completion is answered whole by the other
    server; a streamed one that had streamed ends with the error as its last event."""
    fakes = [await served_vllm(FakeVLLM(str(tiny_llama))) for _ in range(2)]
    try:
        fleet = await Fleet.connect([f.url for f in fakes], lambda u: VLLMBackend.connect(u))
        server = await start(fleet)
        fakes[0].cut = (2, how)  # a new session's engine: the first of two idle ones
        kw = dict(model="fake-vllm", prompt="a b", max_tokens=5,
                  extra_body={"tokendance": {"session": "s", "agent": "a"}})
        r = await client(server).completions.create(**kw)
        assert r.choices[0].text == " w0 w1 w2 w3 w4" and fleet.resent == 1
        assert [len(f.bodies) for f in fakes] == [1, 1]
        (pin,) = fleet.pins.values()
        assert pin.engine == 1
        fakes[1].cut = (2, how)
        texts: list[str] = []
        with pytest.raises(openai.APIError, match="lost|ended"):
            async for chunk in await client(server).completions.create(**kw, stream=True):
                texts += [c.text for c in chunk.choices]
        assert "".join(texts) == " w0 w1" and fleet.resent == 1  # it had streamed: it stays
    finally:
        for f in fakes:
            await f.runner.cleanup()
