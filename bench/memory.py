"""`tokendance bench memory`: resident memory of an engine serving a batch.

Loads the engine with a pool of --kv-tokens, serves --requests chat requests together
through the backend the proxy uses, and reports the process's RSS after loading, after
serving, and at its peak."""

from __future__ import annotations

import argparse
import asyncio
import os
import resource

from tokendance.backend.api import Request, SamplingParams, Segment
from tokendance.backend.service import EngineBackend
from tokendance.bench.options import positive


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-tokens", type=positive, default=16384)
    p.add_argument("--requests", type=positive, default=8)


async def serve(args: argparse.Namespace) -> None:
    be = EngineBackend.load(args.model, dtype=args.dtype, kv_tokens=args.kv_tokens)
    loaded = rss_mib()
    text = be.render_chat([{"role": "user", "content": "Tell me a story about a dragon. " * 40}])
    reqs = [be.prepare(Request(f"m{i}", [Segment(text)], SamplingParams(max_tokens=32, temperature=0)))
            for i in range(args.requests)]

    async def drain(stream) -> None:
        async for _ in stream:
            pass

    await asyncio.gather(*map(drain, be.generate(reqs)))
    pool = be.engine.cache.nbytes / 2**20
    print(f"model {be.info.name}, {args.dtype}, pool {args.kv_tokens} tokens ({pool:.0f} MiB)")
    print("| RSS after load | after serving | peak |\n|---|---|---|")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"| {loaded:.0f} MiB | {rss_mib():.0f} MiB | {peak:.0f} MiB |")
    await be.close()


def main(args: argparse.Namespace) -> int:
    asyncio.run(serve(args))
    return 0
