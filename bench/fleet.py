"""Several engines behind one proxy (backend/fleet.py) against one engine: what a fleet
gives simulations that run side by side.

    tokendance bench fleet [--model PATH] [--engines 2] [--pin gpu|cpu] [--kv-tokens N]
                           [--sessions 4] [--agents 8] [--rounds 3] [--history 400] [--output 48]

Child processes: K engines (`tokendance engine`; `--pin gpu`: engine k sees only GPU k;
`--pin cpu`: engine k runs on core k alone, one thread: cores standing in for GPUs),
a proxy over engine 0 alone and a proxy over all K (`serve --engine ... --engine ...`),
collective mode. The client (httpx) is this process. One pass: S simulations at once,
each a session of N agents and R rounds; every round is announced, agent i's prompt is
its own notes (~`history` words) and, from round 2, every agent's last answer in an
order of its own (All-Gather); answers are `output` tokens (greedy, `ignore_eos`). The
passes alternate between the two proxies, each pass under an API key of its own (no KV
crosses passes); the first of each is a warm-up. Per proxy, medians over the passes:
the pass's wall time, its answers per second, and a round's latency (first request
sent to last answer read; median over the pass's rounds). The last column is the fleet
over one engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import time

import httpx

from tokendance.backend.flags import at_least
from tokendance.bench.options import natural, positive
from tokendance.bench.remote import child, processes
from tokendance.examples import scenario

WORDS = ("river", "market", "harvest", "bridge", "winter", "council", "grain", "stone", "tower", "road",
         "merchant", "storm", "lantern", "orchard", "harbor", "festival", "ledger", "mill", "forest", "well")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or GGUF (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-tokens", type=natural, default=0, help="each engine's KV pool (0: its default)")
    p.add_argument("--engines", type=at_least(2), default=2)
    p.add_argument("--pin", choices=("gpu", "cpu"), default=None,
                   help="engine k on GPU k alone, or on core k alone with one thread (default: unpinned)")
    p.add_argument("--sessions", type=positive, default=4, help="simulations at once")
    p.add_argument("--agents", type=positive, default=8, help="agents per simulation")
    p.add_argument("--rounds", type=positive, default=3)
    p.add_argument("--history", type=positive, default=400, help="words of each agent's own notes")
    p.add_argument("--output", type=positive, default=48, help="tokens of each answer")
    p.add_argument("--repeats", type=positive, default=3)


def notes(agent: str, words: int) -> str:
    """An agent's own notes, the same in every pass (the seed string the figures in
    docs/benchmarks.md were measured with)."""
    rng = random.Random(f"{agent}-0")
    return f"You are {agent}. Your notes: " + " ".join(rng.choice(WORDS) for _ in range(words))


async def simulation(http: httpx.AsyncClient, url: str, model: str, session: str, key: str,
                     args: argparse.Namespace) -> list[float]:
    """One session's rounds; each round's latency in ms."""
    names = scenario.agents(args.agents)
    last: dict[str, str] = {}
    times = []
    for rnd in range(1, args.rounds + 1):
        (await http.post(f"{url}/v1/tokendance/sessions/{session}/rounds/{rnd}", json={"agents": names},
                         headers={"Authorization": f"Bearer {key}"})).raise_for_status()

        async def turn(a: str) -> str:
            text = notes(a, args.history)
            if last:
                text += "\n\n" + scenario.gather(last, scenario.order(a, names)) + "\n\nYour turn."
            r = await http.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json={
                "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": args.output,
                "temperature": 0, "ignore_eos": True, "tokendance": {"session": session, "agent": a, "round": rnd}})
            r.raise_for_status()
            return r.json()["choices"][0]["message"]["content"]

        t0 = time.perf_counter()
        last = dict(zip(names, await asyncio.gather(*(turn(a) for a in names))))
        times.append((time.perf_counter() - t0) * 1e3)
    return times


async def run(args: argparse.Namespace) -> list[tuple[str, list[float], list[float], list[float]]]:
    engine = ["--dtype", args.dtype, "--kv-tokens", str(args.kv_tokens)] + (["--model", args.model] if args.model else [])
    proxy = ["--mode", "collective", "--barrier-timeout-ms", "30000"]
    with contextlib.ExitStack() as stack:
        pins = [_pinned(args.pin, k) for k in range(args.engines)]  # a bad --pin fails before any start
        urls = [url for _, url in stack.enter_context(processes([(["engine", *engine], *pin) for pin in pins]))]
        fronts = {"one engine": stack.enter_context(child(["serve", *proxy, "--engine", urls[0]])),
                  f"{args.engines} engines": stack.enter_context(
                      child(["serve", *proxy, *[f"--engine={u}" for u in urls]]))}
        results = {label: ([], [], []) for label in fronts}
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as http:
            model = (await http.get(urls[0] + "/v1/engine/info")).json()["name"]
            for rep in range(args.repeats + 1):  # the first pass of each warms up
                for label, url in fronts.items():
                    key = f"{label}-{rep}"
                    t0 = time.perf_counter()
                    rounds = await asyncio.gather(*(simulation(http, url, model, f"s{s}-{rep}", key, args)
                                                    for s in range(args.sessions)))
                    wall = time.perf_counter() - t0
                    if rep:
                        answers = args.sessions * args.agents * args.rounds
                        results[label][0].append(wall * 1e3)
                        results[label][1].append(answers / wall)
                        results[label][2].append(statistics.median(t for r in rounds for t in r))
            metrics = (await http.get(fronts[f"{args.engines} engines"] + "/metrics")).text
    pinned = [line.rsplit(" ", 1)[1] for line in metrics.splitlines()
              if line.startswith("tokendance_engine_fleet_sessions{")]
    print(f"sessions per engine (fleet_sessions) at the end: {', '.join(pinned)}")
    return [(label, *r) for label, r in results.items()]


def _pinned(pin: str | None, k: int) -> tuple[dict[str, str] | None, set[int] | None]:
    """Engine k's environment and cores."""
    if pin == "gpu":
        return {"CUDA_VISIBLE_DEVICES": str(k)}, None
    if pin == "cpu":
        if k >= len(os.sched_getaffinity(0)):
            raise ValueError(f"--pin cpu needs a core per engine; this process has {len(os.sched_getaffinity(0))}")
        return {"OMP_NUM_THREADS": "1"}, {sorted(os.sched_getaffinity(0))[k]}
    return None, None


def main(args: argparse.Namespace) -> int:
    rows = asyncio.run(run(args))
    med = [[statistics.median(x) for x in r[1:]] for r in rows]
    print(f"{args.sessions} simulations x {args.agents} agents x {args.rounds} rounds, {args.history}-word notes, "
          f"{args.output}-token answers; medians of {args.repeats}")
    print("| proxy over | pass (ms) | answers/s | round (ms) |\n|---|---|---|---|")
    for (label, *_), (wall, rate, rnd) in zip(rows, med):
        print(f"| {label} | {wall:.0f} | {rate:.2f} | {rnd:.0f} |")
    (w1, r1, d1), (w2, r2, d2) = med
    print(f"| {rows[1][0]} / one | {w2 / w1:.3f}x | {r2 / r1:.3f}x | {d2 / d1:.3f}x |")
    return 0
