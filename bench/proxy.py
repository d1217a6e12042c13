"""Proxy overhead and barrier release latency, with an instant fake backend.

    python -m tokendance.bench.proxy [--requests 500] [--repeats 5] [--only TEXT]

The proxy runs in a child process (so it does not share a core with the client); the
parent fires all requests at once over loopback. Measured inside the proxy:

- overhead: from the request body received to the response done, minus the time held
  at the barrier (until the handler resumed) and the time spent waiting for the backend
  (here ~0): what the proxy itself costs a request.
- release: from the moment the last request of a group entered the proxy until the
  group reached backend.generate (parse, segment, prepare, barrier, dispatch).
- wake: from that last arrival until each waiter of the group resumed with its stream
  (includes answering the waiters woken before it).

Each statistic is taken per repeat (p50, p99), then the median over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import aiohttp
from aiohttp import web

from tokendance.backend.api import Delta, Prepared, Request, Usage
from tokendance.backend.parallel import free_port
from tokendance.backend.protocol import ModelInfo

MODEL = "instant"


class InstantStream:
    """A reply of half the request's max_tokens (8 tokens for the usual 16)."""

    def __init__(self, usage: Usage):
        self.usage = usage

    def __aiter__(self):
        return self._run()

    async def _run(self):
        n = self.usage.completion_tokens
        for i in range(n):
            last = i == n - 1
            yield Delta("end" if last else "tok ", [i], finish_reason="stop" if last else None,
                        usage=self.usage if last else None)

    def abort(self) -> None:
        pass


class InstantBackend:
    """Answers at once: every cost measured is the proxy's."""

    def __init__(self) -> None:
        self.info = ModelInfo(MODEL, 32768, 1024)
        self.generated: list[tuple[float, list[str]]] = []  # (when, request ids) per group

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template: Any = None) -> str:
        return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"

    def prepare(self, request: Request) -> Prepared:
        n = sum(len(s.text) for s in request.segments) // 4 + 1
        return Prepared(request, n)

    def generate(self, group: list[Prepared]) -> list[InstantStream]:
        self.generated.append((time.perf_counter(), [p.request.id for p in group]))
        return [InstantStream(Usage(p.prompt_tokens, max(p.request.sampling.max_tokens // 2, 1))) for p in group]

    def gauges(self) -> list:
        return []

    def problem(self) -> str | None:
        return None

    async def close(self) -> None:
        pass


# The child: the proxy, plus a route that hands over the samples.

def child(port: int) -> None:
    import structlog

    from tokendance.proxy.core import Config
    from tokendance.proxy.listen import Listen
    from tokendance.proxy.server import Server

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    backend = InstantBackend()
    server = Server(backend, Config(barrier_timeout=30.0, max_group=1024))
    calls: list[Any] = []
    server.proxy.observers.append(calls.append)

    async def samples(req: web.Request) -> web.Response:
        out = summarize(calls, backend.generated)
        calls.clear()
        backend.generated.clear()
        return web.json_response(out)

    server.app.router.add_get("/bench/samples", samples)

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await server.start(Listen(port=port))
        await stop.wait()
        await server.stop()

    asyncio.run(run())


def summarize(calls: list[Any], generated: list[tuple[float, list[str]]]) -> dict[str, list[float]]:
    overhead = [c.overhead for c in calls]
    by_id = {c.prepared[0].request.id: c for c in calls}
    release, wake = [], []
    for when, ids in generated:
        group = [by_id[i] for i in ids if i in by_id]
        if len(group) < 2:
            continue  # bypass requests: no barrier
        last = max(c.t0 for c in group)
        release.append(when - last)
        wake += [c.released - last for c in group]
    ms = 1e3
    return {"overhead": [x * ms for x in overhead], "release": [x * ms for x in release],
            "wake": [x * ms for x in wake]}


# The parent: fire the requests, collect the samples.

def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else float("nan")


async def batch(url: str, n: int, sessions: int, stream: bool, tag: str, api: str = "chat") -> float:
    """n concurrent requests over `sessions` announced rounds (0: no session), as chats, as
    responses (the Responses API, stored), as background responses (followed as they
    stream), as responses each in a conversation object of its own, or as Anthropic's
    messages, or as batches of chats (a request per round); wall seconds."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:
        per = n // max(sessions, 1)
        for s in range(sessions if api != "batch" else 0):  # a batch is its round's group: no barrier
            agents = [f"a{i}" for i in range(per)]
            path = f"/v1/tokendance/sessions/{tag}-{s}/rounds/1"
            async with http.post(url + path, json={"agents": agents}) as r:
                assert r.status == 200

        talks: list[str] = []  # each agent's conversation object, made before the clock starts
        for i in range(n if api == "conversation" else 0):
            async with http.post(url + "/v1/conversations", json={"items": [
                    {"role": "user", "content": f"Agent {i}, the debate is about bridges."}]}) as r:
                talks.append((await r.json())["id"])

        async def one(i: int) -> None:
            h = {"X-TokenDance-Session": f"{tag}-{i // per}", "X-TokenDance-Agent": f"a{i % per}"} \
                if sessions else {}
            if api == "batch":
                h.pop("X-TokenDance-Agent", None)
            system, ask = "You are one of many agents in a debate.", \
                f"Agent {i}: here is what the others said. What do you say?"
            if api.startswith("chat"):  # "chat-N-K": N tokens' replies, K to a chunk
                _, *size = api.split("-")
                path, body = "/v1/chat/completions", {"model": MODEL, "stream": stream, "max_tokens": 16, "messages": [
                    {"role": "system", "content": system}, {"role": "user", "content": ask}]}
                if size:
                    body["max_tokens"], body["stream_interval"] = 2 * int(size[0]), int(size[1])
            elif api == "batch":  # agent 0 of each round sends the round's chats
                if i % per:
                    return
                path, body = "/v1/chat/completions/batch", {"model": MODEL, "max_tokens": 16, "messages": [
                    [{"role": "system", "content": system}, {"role": "user", "content": f"Agent {i + k}: ..."}]
                    for k in range(per)], "tokendance": {"agents": [f"a{k}" for k in range(per)]}}
            elif api == "messages":
                path, body = "/v1/messages", {"model": MODEL, "stream": stream, "max_tokens": 16, "system": system,
                                              "messages": [{"role": "user", "content": ask}]}
            else:
                path, body = "/v1/responses", {"model": MODEL, "stream": stream, "max_output_tokens": 16,
                                               "instructions": system, "input": ask}
                if api == "background":
                    body["background"] = True
                if talks:
                    body["conversation"] = talks[i]
            async with http.post(url + path, json=body, headers=h) as r:
                await r.read()
                assert r.status == 200

        t0 = time.perf_counter()
        await asyncio.gather(*[one(i) for i in range(n)])
        return time.perf_counter() - t0


SCENARIOS = [  # name, sessions, stream, api
    ("no session (bypass), JSON", 0, False, "chat"),
    ("no session (bypass), SSE", 0, True, "chat"),
    ("no session (bypass), SSE, 64 tokens", 0, True, "chat-64-1"),
    ("no session (bypass), SSE, 64 tokens, stream_interval 8", 0, True, "chat-64-8"),
    ("1 round x 500 agents", 1, False, "chat"),
    ("50 rounds x 10 agents", 50, False, "chat"),
    ("Responses API, no session, JSON", 0, False, "responses"),
    ("Responses API, no session, SSE", 0, True, "responses"),
    ("Responses API, 50 rounds x 10 agents", 50, False, "responses"),
    ("Responses API, background, SSE", 0, True, "background"),
    ("Responses API, 50 rounds x 10 agents, conversations", 50, False, "conversation"),
    ("Messages API, no session, JSON", 0, False, "messages"),
    ("Messages API, no session, SSE", 0, True, "messages"),
    ("Messages API, 50 rounds x 10 agents", 50, False, "messages"),
    ("batch of chats, 50 rounds x 10 agents", 50, False, "batch"),  # a request per round: req/s counts chats
]


async def measure(url: str, n: int, repeats: int, only: str | None = None) -> list[dict[str, Any]]:
    rows = []
    async with aiohttp.ClientSession() as http:
        for name, sessions, stream, api in [s for s in SCENARIOS if only is None or only in s[0]]:
            stats: dict[str, list[float]] = {}
            tag = f"{api}-{name[:2]}"
            await batch(url, n, sessions, stream, f"warm{tag}", api)
            await (await http.get(url + "/bench/samples")).json()
            for r in range(repeats):
                wall = await batch(url, n, sessions, stream, f"r{r}-{tag}", api)
                s = await (await http.get(url + "/bench/samples")).json()
                for key in ("overhead", "release", "wake"):
                    stats.setdefault(f"{key} p50", []).append(pct(s[key], 0.5))
                    stats.setdefault(f"{key} p99", []).append(pct(s[key], 0.99))
                stats.setdefault("req/s", []).append(n / wall)
            rows.append({"scenario": name, **{k: statistics.median(v) for k, v in stats.items()}})
    return rows


def table(rows: list[dict[str, Any]], n: int, repeats: int) -> str:
    cols = ["overhead p50", "overhead p99", "release p50", "release p99", "wake p50", "wake p99", "req/s"]
    out = [f"{n} concurrent requests, instant backend, median of {repeats} repeats; times in ms.", "",
           "| scenario | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in rows:
        cells = ["—" if r[c] != r[c] else (f"{r[c]:.0f}" if c == "req/s" else f"{r[c]:.3f}") for c in cols]
        out.append(f"| {r['scenario']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--only", default=None, metavar="TEXT", help="only the scenarios whose name holds TEXT")
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    most = max(sessions for _, sessions, *_ in SCENARIOS)
    if a.requests < most:
        p.error(f"--requests must be at least {most}: a scenario spreads them over {most} rounds")
    if a.serve is not None:
        return child(a.serve)
    port = a.port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokendance.bench.proxy", "--serve", str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_up(url))
        rows = asyncio.run(measure(url, a.requests, a.repeats, a.only))
        print(table(rows, a.requests, a.repeats))
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(30)


async def wait_up(url: str) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(300):
            try:
                async with http.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)
    raise TimeoutError("the proxy did not start")


if __name__ == "__main__":
    main()
