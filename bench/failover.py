"""A fleet that loses a session's engine between two rounds, or in the middle of the
second (backend/failover.py): the second round's latency and errors, as the agents see
them, against the same round with no engine lost.

    tokendance bench failover [--model PATH] [--agents 8] [--history 200] [--output 32] [--repeats 3]

Each pass starts two engines (`tokendance engine`) and a proxy over both (collective
mode) in child processes, and runs one session of N agents for two announced rounds
(agent i's prompt: its own notes, ~`history` words, and from round 2 every agent's last
answer in an order of its own; `output` greedy tokens each). The agents are the openai
SDK with its default of two retries, reading their answers whole. In the `lost` pass the
session's engine is killed (SIGKILL) after round 1, before the proxy's poll of it can
notice; in the `mid` pass half of round 1's latency into round 2, while it generates
that round's answers; in the `kept` pass nothing happens. The passes alternate. Per
pass kind, medians over the repeats: round 2's latency (first request sent to last
answer read), and, summed, its barrier groups, the requests the fleet sent again to the
other engine (`fleet_resent_total`; none when the proxy's poll saw the engine gone
first, and the session moved before its requests were sent), the proxy's engine errors
(requests that failed on an engine) and the requests whose agent got an error after
its retries. Last: whether round 2's answers equal the `kept` pass's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import statistics
import time

import httpx

from tokendance.bench.fleet import notes
from tokendance.bench.options import positive
from tokendance.bench.remote import child, processes
from tokendance.examples import scenario

PASSES = ("kept", "lost", "mid")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or GGUF (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--agents", type=positive, default=8)
    p.add_argument("--history", type=positive, default=200, help="words of each agent's own notes")
    p.add_argument("--output", type=positive, default=32, help="tokens of each answer")
    p.add_argument("--repeats", type=positive, default=3)


async def one(args: argparse.Namespace, lose: str) -> dict[str, object]:
    """One pass (of PASSES) on fresh processes: round 2's figures."""
    import openai  # here: `tokendance bench` imports every benchmark, and the GPU host has no openai

    engine = ["engine", "--dtype", args.dtype, "--offload-gib", "0"] + (["--model", args.model] if args.model else [])
    with contextlib.ExitStack() as stack:
        procs = stack.enter_context(processes([(engine, None, None)] * 2))
        urls = [url for _, url in procs]
        front = stack.enter_context(child(["serve", "--mode", "collective", "--barrier-timeout-ms", "30000",
                                           *[f"--engine={u}" for u in urls]]))
        agents = openai.AsyncOpenAI(base_url=front + "/v1", api_key="bench", timeout=600)
        async with httpx.AsyncClient(base_url=front, timeout=600,
                                     headers={"Authorization": "Bearer bench"}) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            names = scenario.agents(args.agents)
            last: dict[str, str] = {}
            failed = 0

            async def turn(a: str, rnd: int) -> str:
                nonlocal failed
                text = notes(a, args.history)
                if last:
                    text += "\n\n" + scenario.gather(last, scenario.order(a, names)) + "\n\nYour turn."
                try:
                    r = await agents.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": text}], max_tokens=args.output,
                        temperature=0, extra_body={"ignore_eos": True,
                                                   "tokendance": {"session": "s", "agent": a, "round": rnd}})
                except openai.APIError:
                    failed += 1
                    return ""
                return r.choices[0].message.content or ""

            async def kill(after: float) -> None:
                """The session's engine, SIGKILLed `after` seconds on."""
                pinned = re.search(r'fleet_sessions\{engine="([^"]+)"\} 1', (await http.get("/metrics")).text)
                proc = procs[urls.index(pinned.group(1))][0]
                await asyncio.sleep(after)
                proc.send_signal(signal.SIGKILL)
                await asyncio.to_thread(proc.wait)

            ms = 0.0
            for rnd in (1, 2):
                if rnd == 2 and lose == "lost":
                    await kill(0.0)
                (await http.post(f"/v1/tokendance/sessions/s/rounds/{rnd}", json={"agents": names})).raise_for_status()
                killer = asyncio.create_task(kill(ms / 2e3)) if rnd == 2 and lose == "mid" else None
                t0 = time.perf_counter()
                last = dict(zip(names, await asyncio.gather(*(turn(a, rnd) for a in names))))
                ms = (time.perf_counter() - t0) * 1e3
                if killer is not None:
                    await killer
            stats = (await http.get("/v1/tokendance/sessions/s/rounds/2")).json()
            metrics = (await http.get("/metrics")).text
        await agents.close()
    return {"ms": ms, "groups": stats["groups"], "resent": _count(metrics, "tokendance_engine_fleet_resent_total"),
            "errors": _count(metrics, "tokendance_engine_errors_total"), "failed": failed, "answers": last}


def _count(metrics: str, name: str) -> int:
    got = re.search(rf"^{name} (\S+)$", metrics, re.M)
    return int(float(got.group(1))) if got else 0


def main(args: argparse.Namespace) -> int:
    runs: dict[str, list[dict[str, object]]] = {p: [] for p in PASSES}
    for _ in range(args.repeats):
        for p in PASSES:
            runs[p].append(asyncio.run(one(args, p)))
    print(f"1 session x {args.agents} agents x 2 rounds, two engines, {args.history}-word notes, "
          f"{args.output}-token answers; round 2, medians of {args.repeats} (counts summed)")
    print("| pass | round 2 (ms) | its groups | sent again | engine errors | agents' errors | answers as kept |")
    print("|---|---|---|---|---|---|---|")
    kept = runs["kept"][0]["answers"]
    med = {}
    for p in PASSES:
        rs = runs[p]
        med[p] = statistics.median(r["ms"] for r in rs)
        each = ", ".join(f"{r['ms']:.0f}" for r in rs)
        same = sum(r["answers"] == kept for r in rs)
        counts = " | ".join(str(sum(r[k] for r in rs)) for k in ("groups", "resent", "errors", "failed"))
        print(f"| {p} | {med[p]:.0f} ({each}) | {counts} | {same}/{len(rs)} |")
    for p in PASSES[1:]:
        print(f"| {p} / kept | {med[p] / med['kept']:.3f}x | | | | | |")
    return 0
