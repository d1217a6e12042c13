"""Two proxies on one broker serving one simulation (`--mqtt-peers`, proxy/peers.py):
agents' requests split between them, a round leaves neither barrier waiting for the
agents that went to the other, and a prompt quoting an answer the other proxy served
shares it."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import aiomqtt
import pytest

from tokendance.proxy.core import Config, Proxy
from tokendance.proxy.server import Server

from .conftest import FakeBackend

MODEL = "fake-tiny"
KEY = {"Authorization": "Bearer sk-test"}


async def ask(server, session: str, agent: str, text: str) -> tuple[dict, dict]:
    h = {"X-TokenDance-Session": session, "X-TokenDance-Agent": agent, **KEY}
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/chat/completions", json=body, headers=h) as r:
            assert r.status == 200, await r.text()
            return await r.json(), dict(r.headers)


@pytest.mark.parametrize("keys", [False, True], ids=["open", "api-key"])
async def test_one_simulation_through_two_proxies(start, broker, until, keys):
    """Under --api-key, in the session namespace of the agents' key (the MQTT open names it)."""
    be = FakeBackend(length=40)  # both proxies in front of one engine
    accepted = frozenset({"sk-test"} if keys else ())
    p1, p2 = [await start(be, mqtt=broker.url, peers=True, barrier_timeout=10.0, api_keys=accepted)
              for _ in range(2)]
    for p in (p1, p2):
        p.control.backoff = (0.05, 0.2)
    await until(lambda: p1.control.connected and p2.control.connected)
    await asyncio.sleep(0.2)  # both subscribed
    owner = p1.proxy.owner(KEY)
    assert bool(owner) == keys
    async with aiomqtt.Client("127.0.0.1", broker.port) as c:
        opened = {"agents": ["ada", "bo"]} | ({"api_key": "sk-test"} if keys else {})
        await c.publish("tokendance/two/round/1/open", json.dumps(opened), qos=1)
    await until(lambda: all((r := p.proxy.sessions.find("two", 1, owner)) and r.gate.expected == {"ada", "bo"}
                            for p in (p1, p2)))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    (a1, h1), (b1, h2) = await asyncio.gather(ask(p1, "two", "ada", "ada thinks the answer is four"),
                                              ask(p2, "two", "bo", "bo thinks the answer is five"))
    assert loop.time() - t0 < 5  # neither waited out its 10 s barrier for the other's agent
    assert (h1["X-TokenDance-Round"], h2["X-TokenDance-Round"]) == ("1", "1")
    ada_said = a1["choices"][0]["message"]["content"]
    bo_said = b1["choices"][0]["message"]["content"]
    # Round 2, nobody announces it: each proxy expects both agents, and knows both answers.
    tenant = p1.proxy.tenant(KEY)
    await until(lambda: p1.proxy.sessions.known("two", 2, tenant, owner).get(bo_said) is not None
                and p2.proxy.sessions.known("two", 2, tenant, owner).get(ada_said) is not None)
    assert p1.proxy.sessions.round("two", 2, owner).gate.expected == {"ada", "bo"}
    t0 = loop.time()
    (a2, h1), (b2, h2) = await asyncio.gather(ask(p1, "two", "ada", f"bo said: {bo_said} and I say"),
                                              ask(p2, "two", "bo", f"ada said: {ada_said} and I say"))
    assert loop.time() - t0 < 5 and (h1["X-TokenDance-Round"], h2["X-TokenDance-Round"]) == ("2", "2")
    for got in (a2, b2):
        assert got["usage"]["tokendance"]["shared_tokens"] > 0  # the other proxy's answer, found
    # ada's third request goes to p2 (the only one of round 3): its count followed it there
    async with aiohttp.ClientSession() as http:
        await http.post(p2.url + "/v1/tokendance/sessions/two/rounds/3", json={"agents": ["ada"]}, headers=KEY)
    _, h = await ask(p2, "two", "ada", "and now?")
    assert h["X-TokenDance-Round"] == "3"


async def test_peers_need_a_broker():
    with pytest.raises(ValueError, match="give --mqtt too"):
        Server(FakeBackend(), Config(peers=True))


async def test_peers_in_front_of_one_fleet_keep_a_session_on_one_engine(start, broker, until):
    from tokendance.backend.fleet import Fleet

    engines = [FakeBackend(length=8) for _ in range(2)]

    def fleet() -> Fleet:
        return Fleet(engines, ["http://e0", "http://e1"])

    p1, p2 = [await start(fleet(), mqtt=broker.url, peers=True, barrier_timeout=0.05) for _ in range(2)]
    for p in (p1, p2):
        p.control.backoff = (0.05, 0.2)
    await until(lambda: p1.control.connected and p2.control.connected)
    await asyncio.sleep(0.2)
    await ask(p2, "other", "x", "a session that loads engine e0 for p2 only")  # p2 alone would pick e1 next
    tenant = Proxy.tenant(KEY)
    await until(lambda: (tenant, "other") in p1.proxy.backend.pins)
    p1.proxy.backend.pins.pop((tenant, "other"))  # p1 sees no load: e0 is its least loaded
    await ask(p1, "one", "ada", "ada speaks first")
    await until(lambda: (tenant, "one") in p2.proxy.backend.pins)
    assert p2.proxy.backend.pins[tenant, "one"].engine == p1.proxy.backend.pins[tenant, "one"].engine
    for k in range(3):  # the session's requests alternate between the proxies
        await ask((p1, p2)[k % 2], "one", "bo", f"bo speaks, turn {k}")
    went = [sum(any(r.session == "one" for r in g) for g in e.groups) for e in engines]
    assert sorted(went) == [0, 4]  # one engine served all four


async def test_stored_responses_and_conversations_go_on_at_either_proxy(start, broker, until):
    be = FakeBackend(length=40)
    p1, p2 = [await start(be, mqtt=broker.url, peers=True, barrier_timeout=0.05) for _ in range(2)]
    for p in (p1, p2):
        p.control.backoff = (0.05, 0.2)
    await until(lambda: p1.control.connected and p2.control.connected)
    await asyncio.sleep(0.2)  # both subscribed

    async def post(server, body: dict, key: dict = KEY) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as http:
            async with http.post(server.url + "/v1/responses", json={"model": MODEL, **body}, headers=key) as r:
                return r.status, await r.json()

    _, first = await post(p1, {"input": "one two", "tokendance": {"session": "talk", "agent": "ada"}})
    tenant = p1.proxy.tenant(KEY)
    await until(lambda: p2.proxy.stored.get(first["id"], tenant) is not None)
    status, second = await post(p2, {"input": "three", "previous_response_id": first["id"]})
    assert status == 200 and second["output"][0]["content"][0]["text"] == "three"
    assert p2.proxy.sessions.find("talk", 2).view()["agents"] == ["ada"]  # the conversation's session, round 2
    history = p2.proxy.stored.get(second["id"], tenant).history
    assert [m.content for m in history] == ["one two", "one two", "three", "three"]
    # another key finds nothing at either proxy; a delete at one deletes at both
    status, _ = await post(p1, {"input": "x", "previous_response_id": second["id"]}, {"Authorization": "Bearer other"})
    assert status == 400
    await until(lambda: p1.proxy.stored.get(second["id"], tenant) is not None)
    async with aiohttp.ClientSession() as http:
        async with http.delete(p1.url + f"/v1/responses/{second['id']}", headers=KEY) as r:
            assert r.status == 200
    await until(lambda: p2.proxy.stored.get(second["id"], tenant) is None)
    assert p2.proxy.stored.get(first["id"], tenant) is not None
    # a conversation object made at one goes on at the other, and its items come back
    async with aiohttp.ClientSession() as http:
        async with http.post(p1.url + "/v1/conversations", json={"items": [{"role": "user", "content": "hi"}]},
                             headers=KEY) as r:
            conv = (await r.json())["id"]
        await until(lambda: p2.proxy.conversations.get(conv, tenant) is not None)
        status, third = await post(p2, {"input": "four five", "conversation": conv})
        assert status == 200 and third["conversation"] == {"id": conv}
        await until(lambda: len(p1.proxy.conversations.get(conv, tenant).items) == 3)
        async with http.get(p1.url + f"/v1/conversations/{conv}/items?order=asc", headers=KEY) as r:
            texts = [i["content"][0]["text"] for i in (await r.json())["data"]]
        assert texts == ["hi", "four five", "four five"]
        async with http.delete(p2.url + f"/v1/conversations/{conv}", headers=KEY) as r:
            assert r.status == 200
    await until(lambda: p1.proxy.conversations.get(conv, tenant) is None)
