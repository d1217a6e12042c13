"""What the remote engine costs: a proxy over `tokendance engine` (backend/remote.py)
against a proxy with the engine in its own process (`tokendance serve`), as each is
deployed.

    tokendance bench remote [--model PATH] [--repeats 15]

Three child processes: `tokendance serve` (the engine in-process), `tokendance engine`
and `tokendance serve --engine URL` in front of it; the same model and settings on both
sides, collective mode. The client (httpx) is this process; the passes alternate, so
one engine computes at a time:

- one token: a short completion of max_tokens 1 (the hop's fixed cost);
- stream: a 32-token greedy chat streamed, to its first token and to its last;
- round: 8 agents of a session round (announced), a shared block each, from the first
  request sent to the last answer read.

Medians over the repeats, in ms; the last column is remote / in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator

import httpx

from tokendance.backend.parallel import free_port
from tokendance.proxy.segment import SEP

AGENTS = 8


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or GGUF (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=15)


async def run(model: str | None, dtype: str, repeats: int) -> list[tuple[str, float, float]]:
    engine = ["--dtype", dtype, "--offload-gib", "0"] + (["--model", model] if model else [])
    proxy = ["--mode", "collective", "--barrier-timeout-ms", "10000"]
    with contextlib.ExitStack() as stack:
        (_, local), (_, far) = stack.enter_context(processes([(["serve", *proxy, *engine], None, None),
                                                              (["engine", *engine], None, None)]))
        remote = stack.enter_context(child(["serve", *proxy, "--engine", far]))
        async with httpx.AsyncClient(timeout=300) as http:
            name = (await http.get(local + "/v1/models")).json()["data"][0]["id"]
            cases = _cases(name)
            times: dict[tuple[str, str], list[float]] = {}
            for rep in range(repeats + 1):  # the first pass warms up
                for label, url in (("local", local), ("remote", remote)):
                    for case, fn in cases.items():
                        for key, ms in (await fn(http, url, f"{label}-{rep}")).items():
                            if rep:
                                times.setdefault((case + key, label), []).append(ms)
    rows = []
    for case in dict.fromkeys(c for c, _ in times):
        a, b = (statistics.median(times[case, side]) for side in ("local", "remote"))
        rows.append((case, a, b))
    return rows


@contextlib.contextmanager
def child(args: list[str], env: dict[str, str] | None = None, cores: set[int] | None = None) -> Iterator[str]:
    """`tokendance ARGS --port P` in a child process (`env` added to this one's, on `cores`
    alone if given); its URL once it answers /health."""
    with process(args, env, cores) as (_, url):
        yield url


@contextlib.contextmanager
def process(args: list[str], env: dict[str, str] | None = None,
            cores: set[int] | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """`child`, and the process (to kill it)."""
    with processes([(args, env, cores)]) as [one]:
        yield one


Spec = tuple[list[str], dict[str, str] | None, set[int] | None]  # args, env, cores


@contextlib.contextmanager
def processes(specs: list[Spec]) -> Iterator[list[tuple[subprocess.Popen, str]]]:
    """Several `process`es, (args, env, cores) each, all started before any is waited for:
    their startups (torch's import, a model's load) overlap."""
    started: list[tuple[subprocess.Popen, str, str]] = []
    ports: set[int] = set()
    try:
        for args, env, cores in specs:
            port = free_port()
            while port in ports:  # none has bound its port yet
                port = free_port()
            ports.add(port)
            argv = [sys.executable, "-m", "tokendance.examples.cli", *args, "--port", str(port), "--log-level",
                    "warning"]
            proc = subprocess.Popen(argv, env={**os.environ, **env} if env else None,
                                    preexec_fn=(lambda c=cores: os.sched_setaffinity(0, c)) if cores else None)
            started.append((proc, f"http://127.0.0.1:{port}", args[0]))
        end = time.monotonic() + 300
        for proc, url, what in started:
            _ready(proc, url, what, end)
        yield [(proc, url) for proc, url, _ in started]
    finally:
        for proc, _, _ in started:
            proc.terminate()
        for proc, _, _ in started:
            proc.wait(60)


def _ready(proc: subprocess.Popen, url: str, what: str, end: float) -> None:
    """Until the process answers /health; RuntimeError if it exits or `end` passes first."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"tokendance {what} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"tokendance {what} did not start within 300 s")
        time.sleep(0.5)


Case = Callable[[httpx.AsyncClient, str, str], Awaitable[dict[str, float]]]


def _cases(name: str) -> dict[str, Case]:
    async def one_token(http: httpx.AsyncClient, url: str, tag: str) -> dict[str, float]:
        t0 = time.perf_counter()
        r = await http.post(url + "/v1/completions", json={"model": name, "prompt": "The bridge", "max_tokens": 1,
                                                     "temperature": 0})
        r.raise_for_status()
        return {"": (time.perf_counter() - t0) * 1e3}

    async def stream(http: httpx.AsyncClient, url: str, tag: str) -> dict[str, float]:
        t0 = time.perf_counter()
        first = None
        body = {"model": name, "messages": [{"role": "user", "content": "Tell me about rivers."}],
                "max_tokens": 32, "temperature": 0, "stream": True, "ignore_eos": True}
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: {") and _content(line[6:]):
                    first = time.perf_counter()
        end = time.perf_counter()
        return {", first token": ((first or end) - t0) * 1e3, ", last token": (end - t0) * 1e3}

    async def round_(http: httpx.AsyncClient, url: str, tag: str) -> dict[str, float]:
        agents = [f"a{i}" for i in range(AGENTS)]
        block = " ".join(f"fact{i}" for i in range(300))
        (await http.post(f"{url}/v1/tokendance/sessions/{tag}/rounds/1", json={"agents": agents})).raise_for_status()

        async def turn(a: str) -> None:
            r = await http.post(url + "/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": f"I am {a}.{SEP}{block}{SEP}Answer."}],
                "max_tokens": 16, "temperature": 0, "ignore_eos": True, "tokendance": {
                    "session": tag, "agent": a, "round": 1, "separators": True}})
            r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(turn(a) for a in agents))
        return {"": (time.perf_counter() - t0) * 1e3}

    return {"one token": one_token, "stream 32": stream, f"round of {AGENTS}": round_}


def _content(chunk: str) -> str:
    choices = json.loads(chunk).get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


def main(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    rows = asyncio.run(run(args.model, args.dtype, args.repeats))
    print("| case | in-process (ms) | remote (ms) | remote / in-process |\n|---|---|---|---|")
    for case, a, b in rows:
        print(f"| {case} | {a:.1f} | {b:.1f} | {b / a:.3f}x |")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    raise SystemExit(main(parser.parse_args()))
