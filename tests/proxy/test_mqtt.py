"""The MQTT control plane against a real broker on loopback (mosquitto, or amqtt)."""

import asyncio
import contextlib
import json

import aiohttp
import aiomqtt
import structlog

MODEL = "fake-tiny"


@contextlib.asynccontextmanager
async def client(broker):
    async with aiomqtt.Client("127.0.0.1", broker.port) as c:
        await c.subscribe("tokendance/+/round/+/done", qos=1)
        yield c


async def next_done(c: aiomqtt.Client, timeout: float = 5.0) -> tuple[str, dict]:
    async with asyncio.timeout(timeout):
        async for msg in c.messages:
            return str(msg.topic), json.loads(msg.payload)


async def ask(server, session: str, agent: str) -> int:
    h = {"X-TokenDance-Session": session, "X-TokenDance-Agent": agent}
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"hello from {agent}"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/chat/completions", json=body, headers=h) as r:
            await r.read()
            return r.status


async def connected(server, until) -> None:
    server.control.backoff = (0.05, 0.2)
    await until(lambda: server.control.connected)


async def test_open_seal_done(start, broker, until):
    server = await start(mqtt=broker.url, barrier_timeout=10.0)
    await connected(server, until)
    async with client(broker) as c:
        await c.publish("tokendance/m/round/1/open", json.dumps({"agents": ["a", "b"]}), qos=1)
        await until(lambda: (r := server.proxy.sessions.find("m", 1)) and r.gate.expected == {"a", "b"})
        assert await asyncio.gather(ask(server, "m", "a"), ask(server, "m", "b")) == [200, 200]
        topic, stats = await next_done(c)
        assert topic == "tokendance/m/round/1/done"
        assert (stats["agents"], stats["requests"], stats["groups"]) == (["a", "b"], 2, 1)
        for key in ("prompt_tokens", "shared_tokens", "reused_tokens", "recomputed_tokens",
                    "kv_dense_bytes", "kv_held_bytes", "barrier_wait_ms", "latency_ms"):
            assert key in stats
        assert stats["prompt_tokens"] > 0 and stats["kv_dense_bytes"] > 0
        async with aiohttp.ClientSession() as http:
            async with http.get(server.url + "/v1/tokendance/sessions/m/rounds/1") as r:
                assert await r.json() == stats

        # Round 2 expects a third agent; sealing over MQTT releases the two that came.
        await c.publish("tokendance/m/round/2/open", json.dumps({"agents": ["a", "b", "c"]}), qos=1)
        await until(lambda: (r := server.proxy.sessions.find("m", 2)) and r.gate.expected == {"a", "b", "c"})
        held = [asyncio.create_task(ask(server, "m", x)) for x in "ab"]
        await until(lambda: server.proxy.barrier.waiting == 2)
        await c.publish("tokendance/m/round/2/seal", b"", qos=1)
        assert await asyncio.gather(*held) == [200, 200]
        topic, stats = await next_done(c)
        assert topic == "tokendance/m/round/2/done" and stats["sealed"] and stats["requests"] == 2


async def test_bad_control_messages_are_ignored(start, broker, until):
    server = await start(mqtt=broker.url)
    await connected(server, until)
    async with client(broker) as c:
        await c.publish("tokendance/x/round/nan/open", b"{}", qos=1)
        await c.publish("tokendance/x/round/1/open", b"{not json", qos=1)
        await c.publish("tokendance/x/round/2/open", b"", qos=1)
    await until(lambda: server.proxy.sessions.find("x", 2) is not None)
    assert server.proxy.sessions.find("x", 1) is None and server.control.connected


async def test_starts_without_a_broker_and_reconnects_after_a_restart(start, idle_broker, until):
    with structlog.testing.capture_logs() as logs:
        server = await start(mqtt=idle_broker.url, barrier_timeout=0.05)
        server.control.backoff = (0.05, 0.2)
        assert await ask(server, "nb", "a") == 200  # serves with no broker at all
        await asyncio.sleep(0.3)  # several retries
    assert not server.control.connected
    said = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert said == ["mqtt broker unreachable, retrying"]  # once, not once per retry
    await idle_broker.start()
    await until(lambda: server.control.connected)
    await idle_broker.stop()
    await until(lambda: not server.control.connected)
    await idle_broker.start()
    await until(lambda: server.control.connected)
    async with client(idle_broker) as c:
        await c.publish("tokendance/rs/round/1/open", json.dumps({"agents": ["a"]}), qos=1)
        await until(lambda: (r := server.proxy.sessions.find("rs", 1)) and r.gate.expected == {"a"})
        assert await ask(server, "rs", "a") == 200
        topic, stats = await next_done(c)
        assert topic == "tokendance/rs/round/1/done" and stats["groups"] == 1
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/metrics") as r:
            assert "tokendance_mqtt_connected 1" in await r.text()


async def test_names_a_broker_refuses_are_a_400_and_later_rounds_still_publish(start, broker, until):
    """A done topic with DEL, a C1 control or a noncharacter made mosquitto drop the proxy,
    which then retried that message forever and never published another round."""
    server = await start(mqtt=broker.url, barrier_timeout=0.05)
    await connected(server, until)
    async with client(broker) as c, aiohttp.ClientSession() as http:
        for bad in ("del\x7f", "c1\x85", "nc\ufdd0", "nc\uffff", "nc" + chr(0x1FFFE)):
            for field in ("session", "agent"):
                tags = {"session": "bad", "agent": "a", field: bad}
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tokendance": tags}
                async with http.post(server.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 400, (bad, field)
                    assert (await r.json())["error"]["param"] == f"tokendance.{field}"
            async with http.post(server.url + f"/v1/tokendance/sessions/{bad}/rounds/1") as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "session"
        assert await ask(server, "ok", "a") == 200
        topic, stats = await next_done(c)
        assert topic == "tokendance/ok/round/1/done" and stats["requests"] == 1
    assert server.control.connected


async def test_a_round_level_that_is_not_plain_digits_is_one_clear_warning(start, broker, until):
    """int() took ' 7', '1_0' and '٣' (published done under another topic) and gave -1 and
    5000 digits a warning with an empty or unrelated error."""
    server = await start(mqtt=broker.url)
    await connected(server, until)
    with structlog.testing.capture_logs() as logs:
        async with client(broker) as c:
            for level in ("-1", " 7", "1_0", "\u0663", "1.5", "9" * 5000):
                await c.publish(f"tokendance/lv/round/{level}/open", b"", qos=1)
            await c.publish("tokendance/lv/round/2/open", b"", qos=1)
        await until(lambda: server.proxy.sessions.find("lv", 2) is not None)
    assert sorted(server.proxy.sessions.all["", "lv"].rounds) == [2]
    said = [e for e in logs if e["log_level"] == "warning"]
    assert len(said) == 6
    assert all(e["error"] == "round must be a non-negative integer" for e in said), said


async def test_an_open_that_is_refused_changes_nothing(start, broker, until):
    """The timeout was applied (and the round made) before a bad agent name was found,
    so a message logged as ignored released round 1 at every arrival."""
    server = await start(mqtt=broker.url, barrier_timeout=10.0)
    await connected(server, until)
    async with client(broker) as c:
        await c.publish("tokendance/pa/round/1/open", json.dumps({"agents": ["a", "x/y"], "timeout_ms": 0}))
        await c.publish("tokendance/pa/round/2/open", b"", qos=1)
        await until(lambda: server.proxy.sessions.find("pa", 2) is not None)
    assert server.proxy.sessions.find("pa", 1) is None
    async with aiohttp.ClientSession() as http:
        url = server.url + "/v1/tokendance/sessions/pb/rounds/1"
        async with http.post(url, json={"agents": ["a", ""], "timeout_ms": 0}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "agents[1]"
        async with http.get(url) as r:
            assert r.status == 404


async def test_retained_commands_are_not_replayed_on_subscribe(start, broker, until):
    """A retained seal of round 1 (from another run) sealed the new round 1 as soon as the
    proxy subscribed: its agents were then served one at a time, with no shared group."""
    async with aiomqtt.Client("127.0.0.1", broker.port) as c:
        await c.publish("tokendance/rt/round/1/seal", b"{}", qos=1, retain=True)  # b"" clears
        await c.publish("tokendance/rt/round/2/open", json.dumps({"agents": ["a"]}), qos=1, retain=True)
    try:
        with structlog.testing.capture_logs() as logs:
            server = await start(mqtt=broker.url, barrier_timeout=10.0)
            await connected(server, until)
            async with client(broker) as c:  # a live command after the retained ones
                await c.publish("tokendance/rt/round/3/open", b"", qos=1)
            await until(lambda: server.proxy.sessions.find("rt", 3) is not None)
        assert server.proxy.sessions.find("rt", 1) is None and server.proxy.sessions.find("rt", 2) is None
        ignored = [e["topic"] for e in logs if e["event"].startswith("mqtt retained")]
        assert sorted(ignored) == ["tokendance/rt/round/1/seal", "tokendance/rt/round/2/open"]
    finally:
        async with aiomqtt.Client("127.0.0.1", broker.port) as c:  # clear the broker's copies
            for t in ("tokendance/rt/round/1/seal", "tokendance/rt/round/2/open"):
                await c.publish(t, b"", qos=1, retain=True)


async def test_an_oversized_control_payload_is_refused_unread(start, broker, until):
    server = await start(mqtt=broker.url)
    await connected(server, until)
    with structlog.testing.capture_logs() as logs:
        async with client(broker) as c:
            big = json.dumps({"agents": [f"a{i}" for i in range(200_000)]})
            await c.publish("tokendance/big/round/1/open", big, qos=1)
            await c.publish("tokendance/big/round/2/open", b"", qos=1)
        await until(lambda: server.proxy.sessions.find("big", 2) is not None)
    assert server.proxy.sessions.find("big", 1) is None
    assert [e["error"] for e in logs if e["event"] == "mqtt message ignored"] == ["payload over 1048576 bytes"]


async def test_a_server_stops_when_aiomqtt_turns_its_cancellation_into_an_error(start, broker, until, monkeypatch):
    """aiomqtt's client, cancelled while it disconnects, may raise its own error (the
    broker's ack lost) instead of the cancellation: the control plane must not take it
    for a lost broker and reconnect, or stopping the server waits forever."""
    real = aiomqtt.Client.__aexit__

    async def aexit(self, kind, exc, tb):
        await real(self, kind, exc, tb)
        if kind is asyncio.CancelledError:
            raise aiomqtt.MqttError("Unexpected disconnection")

    monkeypatch.setattr(aiomqtt.Client, "__aexit__", aexit)
    server = await start(mqtt=broker.url)
    await connected(server, until)
    stopping = asyncio.create_task(server.stop())
    done, _ = await asyncio.wait({stopping}, timeout=10)
    assert done, "the control plane reconnected instead of stopping"


async def test_a_server_stopped_at_any_moment_of_its_connecting_stops_and_leaves_no_connection(start, broker):
    """Stopped while its MQTT client connects or subscribes: Python 3.11's wait_for, which
    aiomqtt awaits in, may drop the cancellation of a call completing in that moment (the
    control task then served on and stop() waited forever), and aiomqtt leaves a
    connection it was cancelled in the middle of making open, pinging the broker."""
    for i in range(40):  # each stop lands at another moment of the connection
        server = await start(mqtt=broker.url)
        await asyncio.sleep(i * 0.0005)
        stopping = asyncio.create_task(server.stop())
        done, _ = await asyncio.wait({stopping}, timeout=10)
        assert done, f"stop {i} did not end"
        stopping.result()
    await asyncio.sleep(0.2)  # a connection left open keeps its client's keepalive task
    assert not [t for t in asyncio.all_tasks() if "_misc_loop" in repr(t.get_coro())]
