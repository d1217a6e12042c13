"""Sessions under --api-key: each key's requests and round control see only that key's
sessions, so two tenants that name one session run two simulations; without --api-key
keys are not checked, and one name is one session for everyone. Over MQTT an open or a
seal names its key in the payload."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import aiomqtt
import pytest
import structlog

MODEL = "fake-tiny"
KA, KB = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}


async def ask(http, server, key: dict, agent: str) -> dict:
    h = {"X-TokenDance-Session": "s", "X-TokenDance-Agent": agent, **key}
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"{agent} has a long opinion to share"}]}
    async with http.post(server.url + "/v1/chat/completions", json=body, headers=h) as r:
        assert r.status == 200, await r.text()
        return dict(r.headers)


async def control(http, server, key: dict, tail: str = "", method: str = "post", **body) -> dict:
    url = server.url + "/v1/tokendance/sessions/s/rounds/1" + tail
    async with http.request(method, url, json=body or None, headers=key) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_two_keys_that_name_one_session_hold_two(start):
    server = await start(barrier_timeout=10.0, api_keys=frozenset({"ka", "kb"}))
    async with aiohttp.ClientSession() as http:
        await control(http, server, KA, agents=["a1", "a2"])
        await control(http, server, KB, agents=["a2"])
        first = asyncio.create_task(ask(http, server, KA, "a1"))
        await ask(http, server, KB, "a2")  # kb's round: all there, released at once
        await asyncio.sleep(0.1)
        assert not first.done()  # ka's a2 is not kb's a2: ka's barrier still waits for it
        await ask(http, server, KA, "a2")
        await first
        a, b = await control(http, server, KA, method="get"), await control(http, server, KB, method="get")
    assert (a["agents"], a["group_sizes"], a["requests"]) == (["a1", "a2"], [2], 2)
    assert (b["agents"], b["group_sizes"], b["requests"]) == (["a2"], [1], 1)


async def test_without_api_keys_one_name_is_one_session(start):
    server = await start(barrier_timeout=10.0)
    async with aiohttp.ClientSession() as http:
        await control(http, server, KA, agents=["a1", "a2"])
        await asyncio.gather(ask(http, server, KA, "a1"), ask(http, server, KB, "a2"))
        got = await control(http, server, {}, method="get")
    assert (got["agents"], got["group_sizes"]) == (["a1", "a2"], [2])


async def test_an_api_key_in_an_http_control_body_is_a_400(start):
    server = await start(api_keys=frozenset({"ka"}))
    async with aiohttp.ClientSession() as http:
        url = server.url + "/v1/tokendance/sessions/s/rounds/1"
        async with http.post(url, json={"agents": ["a"], "api_key": "ka"}, headers=KA) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "api_key"


async def test_mqtt_opens_and_seals_name_their_key(start, broker, until):
    server = await start(mqtt=broker.url, barrier_timeout=10.0, api_keys=frozenset({"ka", "kb"}))
    server.control.backoff = (0.05, 0.2)
    await until(lambda: server.control.connected)
    owner = server.proxy.owner(KA)
    with structlog.testing.capture_logs() as logs:
        async with aiomqtt.Client("127.0.0.1", broker.port) as c:
            for payload in ({"agents": ["a1"]}, {"agents": ["a1"], "api_key": "nope"}):
                await c.publish("tokendance/s/round/1/open", json.dumps(payload), qos=1)
            await c.publish("tokendance/s/round/1/open", json.dumps({"agents": ["a1"], "api_key": "ka"}), qos=1)
            await until(lambda: server.proxy.sessions.find("s", 1, owner) is not None)
            await c.publish("tokendance/s/round/2/seal", json.dumps({"api_key": "ka"}), qos=1)
            await until(lambda: (r := server.proxy.sessions.find("s", 2, owner)) is not None and r.gate.sealed)
    assert server.proxy.sessions.find("s", 1, owner).gate.expected == {"a1"}
    assert server.proxy.sessions.find("s", 1) is None and server.proxy.sessions.find("s", 1, server.proxy.owner(KB)) is None
    ignored = [e for e in logs if e["event"] == "mqtt message ignored"]
    assert len(ignored) == 2 and all("api_key" in e["error"] for e in ignored), ignored
    async with aiohttp.ClientSession() as http:
        await ask(http, server, KA, "a1")  # released at once: ka's round 1 expects a1 alone


@pytest.mark.parametrize("keys", [frozenset(), frozenset({"ka"})])
async def test_a_stored_conversation_stays_in_its_owners_session(start, keys):
    server = await start(barrier_timeout=0.05, api_keys=keys)
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "input": "one two", "tokendance": {"session": "s", "agent": "a1"}}
        async with http.post(server.url + "/v1/responses", json=body, headers=KA) as r:
            first = await r.json()
        body = {"model": MODEL, "input": "three", "previous_response_id": first["id"]}
        async with http.post(server.url + "/v1/responses", json=body, headers=KA) as r:
            assert r.headers["X-TokenDance-Round"] == "2" and r.headers["X-TokenDance-Agent"] == "a1"
    owner = server.proxy.owner(KA)
    assert server.proxy.sessions.find("s", 2, owner).stats.requests == 1
