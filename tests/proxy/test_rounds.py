"""Sessions, rounds and the barrier through the HTTP API."""

import asyncio
import time

import aiohttp
import openai

MODEL = "fake-tiny"


def headers(session: str, agent: str | None = None, **more: str) -> dict[str, str]:
    h = {"X-TokenDance-Session": session, **more}
    return h | ({"X-TokenDance-Agent": agent} if agent else {})


async def post(url: str, path: str, body: dict | None = None,
               h: dict | None = None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body, headers=h or {}) as r:
            return r.status, await r.json(), dict(r.headers)


async def chat(url: str, text: str, h: dict) -> tuple[int, dict, dict]:
    return await post(url, "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": text}]}, h)


async def test_32_agents_5_rounds_one_group_per_round_and_automatic_sharing(start):
    server = await start(barrier_timeout=10.0)
    c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    agents = [f"agent{i:02d}" for i in range(32)]
    st, _, _ = await post(server.url, "/v1/tokendance/sessions/debate/rounds/1", {"agents": agents})
    assert st == 200
    previous: list[str] = []

    async def turn(i: int, a: str, r: int) -> str:
        # Private history first, then every agent's previous answer (a different order each).
        others = "\n".join(previous[i:] + previous[:i])
        msgs = [{"role": "system", "content": f"You are {a}."},
                {"role": "user",
                 "content": f"Round {r}. Answers so far:\n{others}\nNow give your view, {a} r{r}?"}]
        h = headers("debate", a)
        if i % 2:
            stream = await c.chat.completions.create(model=MODEL, messages=msgs, stream=True,
                                                     extra_headers=h)
            chunks = [ch async for ch in stream]
            assert [ch.choices[0].finish_reason for ch in chunks].count("stop") == 1
            return "".join(ch.choices[0].delta.content or "" for ch in chunks)
        resp = await c.chat.completions.create(model=MODEL, messages=msgs, extra_headers=h)
        assert len(resp.choices) == 1 and resp.choices[0].finish_reason == "stop"
        return resp.choices[0].message.content

    for r in range(1, 6):
        t0 = time.perf_counter()
        answers = await asyncio.gather(*[turn(i, a, r) for i, a in enumerate(agents)])
        assert time.perf_counter() - t0 < 5.0  # released by arrivals, not by the 10 s timeout
        assert answers == [f"Now give your view, {a} r{r}?" for a in agents]  # the fake echoes
        stats = server.proxy.sessions.find("debate", r).view()
        assert (stats["groups"], stats["requests"], stats["agents"]) == (1, 32, agents)
        assert stats["errors"] == stats["aborted"] == 0
        if r > 1:  # every previous answer was found in every prompt, and reused
            assert stats["shared_tokens"] == 32 * 32 * 6  # 32 answers of 6 tokens in 32 prompts
            assert stats["reused_tokens"] == stats["shared_tokens"] - 32 * 6  # computed once each
        previous = answers
    groups = server.proxy.backend.groups
    assert [len(g) for g in groups] == [32] * 5
    assert [{q.round for q in g} for g in groups] == [{1}, {2}, {3}, {4}, {5}]
    producers = {s.producer for q in groups[4] for s in q.segments if s.shared}
    assert producers == {("debate", a, 4) for a in agents}
    await c.close()


async def test_seal_releases_a_partial_group_and_lets_latecomers_through(start, until):
    server = await start(barrier_timeout=5.0)
    base = "/v1/tokendance/sessions/s/rounds/1"
    await post(server.url, base, {"agents": ["a", "b", "c"]})
    held = [asyncio.create_task(chat(server.url, f"hello {x}", headers("s", x))) for x in "ab"]
    await until(lambda: server.proxy.barrier.waiting == 2)
    assert not any(t.done() for t in held)
    st, view, _ = await post(server.url, base + "/seal")
    assert st == 200 and view["sealed"]
    assert [(await t)[1]["choices"][0]["message"]["content"] for t in held] == ["hello a", "hello b"]
    t0 = time.perf_counter()
    st, _, h = await chat(server.url, "late c", headers("s", "c"))
    assert st == 200 and h["X-TokenDance-Group"] == "1" and time.perf_counter() - t0 < 1.0
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + base) as r:
            stats = await r.json()
    assert (stats["groups"], stats["group_sizes"], stats["agents"]) == (2, [2, 1], ["a", "b", "c"])


async def test_a_round_sealed_before_it_opens_holds_nobody(start):
    """Sealing may come first (a framework that never waits for its agents): the round
    exists from then on, sealed, and its requests go at once."""
    server = await start(barrier_timeout=5.0)
    base = "/v1/tokendance/sessions/early/rounds/3"
    st, view, _ = await post(server.url, base + "/seal")
    assert st == 200 and view["sealed"] and view["requests"] == 0
    t0 = time.perf_counter()
    st, body, h = await chat(server.url, "first", headers("early", "a", **{"X-TokenDance-Round": "3"}))
    assert st == 200 and body["choices"][0]["message"]["content"] == "first"
    assert h["X-TokenDance-Round"] == "3" and time.perf_counter() - t0 < 1.0


async def test_timeout_releases_and_bounds_the_wait(start):
    server = await start(barrier_timeout=0.1)
    await post(server.url, "/v1/tokendance/sessions/t/rounds/1", {"agents": ["a", "b"]})
    t0 = time.perf_counter()
    st, body, _ = await chat(server.url, "alone here", headers("t", "a"))
    assert st == 200 and body["choices"][0]["message"]["content"] == "alone here"
    assert 0.09 <= time.perf_counter() - t0 < 1.0
    stats = server.proxy.sessions.find("t", 1).view()
    assert 90 <= stats["barrier_wait_ms"] < 1000


async def test_open_can_set_the_round_timeout(start):
    server = await start(barrier_timeout=10.0)
    await post(server.url, "/v1/tokendance/sessions/o/rounds/2", {"agents": ["a", "b"], "timeout_ms": 50})
    t0 = time.perf_counter()
    st, _, h = await chat(server.url, "x", headers("o", "a", **{"X-TokenDance-Round": "2"}))
    assert st == 200 and h["X-TokenDance-Round"] == "2" and time.perf_counter() - t0 < 1.0


async def test_requests_without_a_session_bypass_the_barrier(start):
    server = await start(barrier_timeout=10.0)
    t0 = time.perf_counter()
    results = await asyncio.gather(*[chat(server.url, f"free {i}", {}) for i in range(5)])
    assert all(st == 200 and "X-TokenDance-Round" not in h for st, _, h in results)
    assert time.perf_counter() - t0 < 1.0
    assert server.proxy.sessions.all == {}


async def test_anonymous_requests_group_by_burst(start):
    server = await start(barrier_timeout=0.1)
    first = await asyncio.gather(*[chat(server.url, f"anon {i}", headers("anon")) for i in range(3)])
    assert {h["X-TokenDance-Round"] for _, _, h in first} == {"1"}
    assert {h["X-TokenDance-Group"] for _, _, h in first} == {"3"}
    _, _, h = await chat(server.url, "next", headers("anon"))
    assert h["X-TokenDance-Round"] == "2"


async def test_explicit_round_moves_an_agents_count(start):
    server = await start(barrier_timeout=0.0)
    rounds = []
    for r in (None, "7", None):
        extra = {"X-TokenDance-Round": r} if r else {}
        _, _, h = await chat(server.url, "x", headers("e", "a", **extra))
        rounds.append(h["X-TokenDance-Round"])
    assert rounds == ["1", "7", "8"]


async def test_body_metadata_wins_over_headers_and_mode_reaches_the_backend(start):
    server = await start(barrier_timeout=0.0)
    st, _, h = await post(server.url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "tokendance": {"session": "body", "agent": "b", "round": 4, "mode": "prefix"}},
        headers("hdr", "h", **{"X-TokenDance-Round": "9"}))
    assert st == 200
    assert (h["X-TokenDance-Session"], h["X-TokenDance-Agent"], h["X-TokenDance-Round"]) == ("body", "b", "4")
    q = server.proxy.backend.groups[-1][0]
    assert (q.session, q.agent, q.round, q.mode) == ("body", "b", 4, "prefix")


async def test_max_group_splits_a_round(start):
    server = await start(barrier_timeout=5.0, max_group=4)
    agents = [f"a{i}" for i in range(10)]
    await post(server.url, "/v1/tokendance/sessions/m/rounds/1", {"agents": agents})
    results = await asyncio.gather(*[chat(server.url, f"hi {a}", headers("m", a)) for a in agents])
    assert all(st == 200 for st, _, _ in results)
    assert sorted(server.proxy.sessions.find("m", 1).view()["group_sizes"]) == [2, 4, 4]


async def test_a_tenant_never_finds_another_tenants_outputs_in_its_prompts(start):
    # Session names are global; each API key's segment cache is its own. Finding tenant A's
    # outputs in tenant B's prompts would tell B (shared_tokens) what A's agents said.
    server = await start(barrier_timeout=0.0)
    secret = "the launch code is four four two one"

    async def say(key: str, agent: str, text: str) -> dict:
        h = headers("shared-name", agent, Authorization=f"Bearer {key}")
        _, body, _ = await post(server.url, "/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "user", "content": text}]}, h)
        return body["usage"]["tokendance"]

    await say("key-a", "x", secret)  # the fake answers with the message's last words: the secret
    assert (await say("key-b", "y", f"did someone say: {secret}?"))["shared_tokens"] == 0
    assert (await say("key-a", "z", f"did someone say: {secret}?"))["shared_tokens"] == 6  # the answer's words
