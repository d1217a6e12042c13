"""A beam search through a fleet of engines: its steps kept on one engine (their route,
backend/fleet.py) against the steps taking the engines in turn, as requests outside a
session did before routes. Both through the proxy over HTTP, over in-process engines of
the same model (`prefix` mode, each its own prefix cache).

    tokendance bench beam-routes [--model PATH] [--engines 2] [--width 3] [--tokens 32] [--repeats 3]

Each search has a prompt of its own, so no engine has cached it before; the figures are
the prompt tokens the steps computed (their prompts less what the prefix caches held)
and the wall time, medians over the repeats, the two ways in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from contextlib import contextmanager
from dataclasses import replace

from tokendance.bench import beams


def add_args(p: argparse.ArgumentParser) -> None:
    beams.add_args(p)  # --model, --dtype, --width, --tokens, --repeats
    p.add_argument("--engines", type=int, default=2, choices=range(2, 9), metavar="2-8")
    p.set_defaults(width=3, repeats=3)


def main(args: argparse.Namespace) -> int:
    return asyncio.run(_main(args))


@contextmanager
def in_turn(on: bool):
    """While `on`, the fleet drops every request's route: the steps take the engines in turn."""
    from tokendance.backend.fleet import Fleet

    route = Fleet.route
    if on:
        Fleet.route = lambda self, request: route(self, replace(request, route=None))
    try:
        yield
    finally:
        Fleet.route = route


@contextmanager
def counted():
    """The prompt tokens the beam search's steps computed (prompt less cached), in [0]."""
    import tokendance.proxy.beams as search

    last, n = search._last, [0]

    async def count(stream):
        d = await last(stream)
        if d.usage is not None:
            n[0] += d.usage.prompt_tokens - d.usage.cached_tokens
        return d

    search._last = count
    try:
        yield n
    finally:
        search._last = last


async def _main(args: argparse.Namespace) -> int:
    import httpx

    from tokendance.backend.fleet import Fleet
    from tokendance.examples.local import backend, proxy

    engines = [backend(args.model, "prefix", dtype=args.dtype) for _ in range(args.engines)]
    fleet = Fleet(engines)
    tok = engines[0].engine.tokenizer
    ways = {"one engine (routed)": False, "engines in turn": True}
    times: dict[str, list[float]] = {w: [] for w in ways}
    work: dict[str, list[int]] = {w: [] for w in ways}
    k = 0
    async with proxy(fleet) as url, httpx.AsyncClient(base_url=url, timeout=3600) as client:
        async def search(turn: bool) -> tuple[float, int]:
            nonlocal k
            k += 1  # a prompt of its own
            text = engines[0].render_chat([{"role": "user", "content": f"Story number {k}. {beams.ASK}"}])
            body = {"model": fleet.info.name, "prompt": tok(text, add_special_tokens=False)["input_ids"],
                    "n": args.width, "max_tokens": args.tokens, "ignore_eos": True, "temperature": 0,
                    "use_beam_search": True}
            with in_turn(turn), counted() as n:
                t = time.perf_counter()
                r = await client.post("/completions", json=body)
                dt = time.perf_counter() - t
            r.raise_for_status()
            return dt, n[0]

        await search(False)  # warm-up
        for _ in range(args.repeats):
            for way, turn in ways.items():
                dt, n = await search(turn)
                times[way].append(dt)
                work[way].append(n)
    print(f"beam width {args.width}, {args.tokens} tokens, {args.engines} engines "
          f"({engines[0].info.name}, {args.dtype}), medians of {args.repeats}:")
    for way in ways:
        print(f"  {way:<20} {statistics.median(work[way]):>8,.0f} prompt tokens computed "
              f"{statistics.median(times[way]) * 1e3:>9.0f} ms")
    a, b = (statistics.median(work[w]) for w in ways)
    ta, tb = (statistics.median(times[w]) for w in ways)
    print(f"  routed / in turn: tokens {a / b:.2f}x, time {ta / tb:.2f}x")
    return 0
