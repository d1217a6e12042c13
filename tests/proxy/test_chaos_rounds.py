"""Random multi-agent simulations through the proxy and the real engine: sessions whose
agents quote each other's last answers, requests of every mode, streamed or not, some
late for their barrier, some of their clients gone at any moment (at the barrier, mid
answer). Every request whose client stays gets its whole answer; at recompute ratio 1
every answer of an exact mode is the one the same chat gets alone in `full`; and once
the server stops, the engine holds no request and, its caches reset, no block."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import aiohttp

from tokendance.backend.service import EngineBackend
from tokendance.proxy.core import Config
from tokendance.proxy.listen import Listen
from tokendance.proxy.server import Server

EXACT = ("full", "prefix", "pic", "collective")
ANCHORED = ("kvcomm", "kvcmas")  # predicted: checked for whole answers, not tokens


@dataclass
class Turn:
    session: str
    agent: str
    messages: list[dict]
    mode: str
    max_tokens: int
    sent: bool = False  # its request went out (its client may have gone since)
    text: str | None = None  # the answer, when its client stayed
    finish: str | None = None


async def ask(http: aiohttp.ClientSession, url: str, model: str, t: Turn, stream: bool,
              round_: int | None) -> None:
    headers = {"X-TokenDance-Session": t.session, "X-TokenDance-Agent": t.agent, "X-TokenDance-Mode": t.mode}
    if round_ is not None:
        headers["X-TokenDance-Round"] = str(round_)
    body = {"model": model, "messages": t.messages, "max_tokens": t.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    t.sent = True
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        if not stream:
            choice = (await resp.json())["choices"][0]
            t.text, t.finish = choice["message"]["content"], choice["finish_reason"]
            return
        parts, finish = [], None
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                parts.append(c["delta"].get("content") or "")
                finish = c["finish_reason"] or finish
        t.text, t.finish = "".join(parts), finish


async def simulate(url: str, model: str, rng: random.Random, session: str, modes: tuple[str, ...],
                   agents: int, rounds: int) -> list[Turn]:
    """One session's rounds: each agent's chat goes on with the others' last answers (those
    whose clients stayed) and its own."""
    turns: list[Turn] = []
    last: dict[str, str] = {}
    chats = {f"agent{a}": [{"role": "system", "content": f"You are agent{a}. Debate briefly."}]
             for a in range(agents)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for r in range(1, rounds + 1):
            batch = []
            for name, chat in chats.items():
                quoted = "\n".join(f"{k} said: {v}" for k, v in sorted(last.items()) if k != name)
                chat.append({"role": "user", "content": f"Round {r}.\n{quoted}\nWhat do you say?"})
                batch.append(Turn(session, name, list(chat), rng.choice(modes), rng.randrange(2, 9)))

            async def one(t: Turn, delay: float, gone: float | None, stream: bool, explicit: bool) -> None:
                await asyncio.sleep(delay)  # some come after their group left
                if gone is not None:  # the client goes: at the barrier, mid answer, or too late
                    asyncio.get_running_loop().call_later(gone, asyncio.current_task().cancel)
                await ask(http, url, model, t, stream, r if explicit else None)

            tasks = [asyncio.create_task(one(t, rng.random() * 0.5,
                                             rng.random() * 0.5 if rng.random() < 0.2 else None,
                                             rng.random() < 0.5, rng.random() < 0.5)) for t in batch]
            await asyncio.gather(*tasks, return_exceptions=True)
            for t, task in zip(batch, tasks):
                if not task.cancelled():
                    task.result()  # a stayed client's failure fails the test
                    last[t.agent] = t.text
                    chats[t.agent].append({"role": "assistant", "content": t.text})
            turns += batch
    return turns


async def play(model_dir: str, seed: int) -> dict[str, float]:
    """One server, three simulations at once (a session of `collective`, the server's
    mode, one of every exact mode, one of the predicted ones), every check made; what
    it exercised."""
    # a host tier of 32 pages of 2 MiB: a parked agent and its Masters take a few
    backend = EngineBackend.load(model_dir, dtype="float32", mode="collective", recompute_ratio=1.0,
                                 min_shared_tokens=0, kv_tokens=16 * 24, max_batched_tokens=128,
                                 offload_bytes=64 << 20)
    eng = backend.engine
    server = Server(backend, Config(barrier_timeout=0.3))
    await server.start(Listen(port=0))
    try:
        rng, model = random.Random(seed), backend.info.name
        runs = [simulate(server.url, model, random.Random(rng.random()), name, modes, agents, 4)
                for name, modes, agents in (("s0", ("collective",), 4), ("s1", EXACT, 4), ("s2", ANCHORED, 3))]
        turns = [t for run in await asyncio.gather(*runs) for t in run]
        answered = [t for t in turns if t.text is not None]
        assert all(t.finish == "length" for t in answered)
        async with aiohttp.ClientSession() as http:
            for t in answered:  # each exact answer against the same chat alone, no session, no reuse
                if t.mode in EXACT:
                    async with http.post(server.url + "/v1/chat/completions", json={
                            "model": model, "messages": t.messages, "max_tokens": t.max_tokens,
                            "temperature": 0, "ignore_eos": True, "tokendance": {"mode": "full"}}) as resp:
                        alone = (await resp.json())["choices"][0]["message"]["content"]
                    assert t.text == alone, (seed, t.session, t.agent, t.mode)
            async with http.get(server.url + "/health") as h:
                assert (await h.json())["in_flight"] == 0
        tokens = {dict(k)["kind"]: v for k, v in server.proxy.metrics.tokens.values.items()}
    finally:
        await server.stop()
    assert not eng.seqs
    eng.reset_caches()
    assert eng.pool.num_free == eng.cache.num_blocks and not eng.idle.parked and eng.idle.bytes == 0
    return {"gone": sum(t.sent and t.text is None for t in turns), "shared": tokens["shared"],
            "cached": tokens["cached"], "restored": eng.idle.restored, "preempted": eng.scheduler.preemptions}


async def test_random_simulations_answer_every_client_exactly_and_leak_nothing(tiny_llama):
    seen = [await play(str(tiny_llama), seed) for seed in (1, 2, 3)]
    # what they were to exercise (their timing varies: over all three): clients gone after
    # sending, answers found in prompts and reused, agents restored from the host tier, a
    # pool that preempts
    assert all(sum(s[k] for s in seen) for k in seen[0]), seen
