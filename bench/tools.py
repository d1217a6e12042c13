"""Rounds of agents that call a tool and then answer, through the proxy, in each reuse
mode: what a tool loop costs a round, and what the turn's second request reuses.

    tokendance bench tools [--model PATH] [--agents 4,8] [--rounds 2] [--repeats 3]
                           [--min-shared-tokens N] [--recompute-ratio R] ...

One engine behind the proxy (in-process, on its own thread; the openai SDK's async
client here). In round r each of N agents (one session, the round announced) asks,
with two tools, for one call (`tool_choice` required, `parallel_tool_calls` false); it
runs the tool here at once and sends the result back (the turn's second request,
`tool_choice` none, `ignore_eos`: every mode decodes the same answer length), without
waiting for the others. From round 2 its question quotes every other agent's last
answer (All-Gather). Per mode (`tokendance.mode` per request) and round: the time from
the round's first request sent to its last answer read, the barrier groups the round
formed, and the share of prompt tokens answered from cache, of the turns' first
requests (the calls, one barrier group) and of their second ones (the answers, each
resuming its turn alone once its group left). "decoded" counts the round's generated
tokens: a call's length follows the tool and arguments the model picks, which reuse can
change. Repeats alternate modes, each under its own API key (no KV crosses repeats);
medians. A figure against `full` is that mode's round time over full's in the same
repeat. Last, the round-1 questions once more with `tool_choice` auto: how many the
model answers with a call at all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from tokendance.backend.flags import add_reuse_args, reuse_options
from tokendance.bench.options import counts, natural, positive
from tokendance.examples import scenario

MODES = ("full", "prefix", "collective")
GOODS = ["wheat", "salt", "wool", "iron", "honey", "cloth", "wine", "oil"]
TOWNS = ["Riverton", "Hillcrest", "Lakeside", "Stonebridge"]
TOOLS = [
    {"type": "function", "function": {"name": "get_price", "description": "Today's market price of a good",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["good"],
                                                     "properties": {"good": {"enum": GOODS}}}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Today's weather in a town",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "required": ["town"],
                                                     "properties": {"town": {"enum": TOWNS}}}}},
]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or GGUF (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--agents", type=counts, default=[4, 8], help="agents per round, e.g. 4,8")
    p.add_argument("--rounds", type=positive, default=2)
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--max-tokens", type=positive, default=32, help="tokens of each answer")
    p.add_argument("--offload-gib", type=natural, default=1,
                   help="host memory for parked agents (0: off, nothing parked or restored)")
    add_reuse_args(p)


def run_tool(name: str, args: dict[str, Any]) -> str:
    if name == "get_price":
        return f"{args['good']} sells for {3 + GOODS.index(args['good'])} coins a sack today."
    return f"{args['town']} is {['sunny', 'rainy', 'windy', 'foggy'][TOWNS.index(args['town'])]} today."


async def turn(client: Any, model: str, hdr: dict, mode: str, messages: list[dict], max_tokens: int) -> dict:
    """One agent's turn: the call, the tool, the answer. Returns the answer and both
    requests' prompt and cached tokens."""
    extra = {"tokendance": {"mode": mode}}
    asked = await client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=48, temperature=0, extra_headers=hdr, extra_body=extra)
    first = asked.usage
    call = asked.choices[0].message.tool_calls[0]
    result = run_tool(call.function.name, json.loads(call.function.arguments))
    convo = messages + [asked.choices[0].message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": result}]
    answer = await client.chat.completions.with_raw_response.create(  # the same length in every mode
        model=model, messages=convo, tools=TOOLS, tool_choice="none", max_tokens=max_tokens, temperature=0,
        extra_headers=hdr, extra_body={**extra, "ignore_eos": True})
    done = answer.parse()
    u = done.usage
    return {"text": done.choices[0].message.content, "group": answer.headers["X-TokenDance-Group"],
            "decoded": first.completion_tokens + u.completion_tokens,
            "prompt": (first.prompt_tokens, u.prompt_tokens),
            "cached": (first.prompt_tokens_details.cached_tokens, u.prompt_tokens_details.cached_tokens)}


def question(me: str, i: int, r: int, last: dict[str, str]) -> list[dict]:
    ask = f"Should {me} sell {GOODS[i % len(GOODS)]} in {TOWNS[i % len(TOWNS)]} today? Check first."
    if r > 1:
        heard = "\n\n".join(f"{a} said:\n{t}" for a, t in last.items() if a != me)
        ask = f"Last round the others said this.\n\n{heard}\n\n{ask}"
    return [{"role": "system", "content": f"You are {me}, a trader in a market town. Answer in one sentence."},
            {"role": "user", "content": ask}]


async def simulate(url: str, model: str, n: int, rounds: int, mode: str, key: str, max_tokens: int) -> list[dict]:
    import openai

    from tokendance.adapters.rounds import Rounds

    session = f"tools-{key}"
    client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)
    ctl = Rounds(session, url, api_key=key)
    agents = scenario.agents(n)
    last: dict[str, str] = {}
    out = []
    for r in range(1, rounds + 1):
        await ctl.aannounce(r, agents)
        t0 = time.perf_counter()
        turns = await asyncio.gather(*(
            turn(client, model, {"X-TokenDance-Session": session, "X-TokenDance-Agent": a}, mode,
                 question(a, i, r, last), max_tokens) for i, a in enumerate(agents)))
        ms = (time.perf_counter() - t0) * 1e3
        stats = await ctl.astats(r)
        if any(t["group"] != "1" for t in turns) or stats["requests"] != 2 * n:
            raise RuntimeError(f"round {r} did not resume its turns alone: {stats}")
        last = {a: t["text"] for a, t in zip(agents, turns)}
        out.append({"ms": ms, "groups": stats["groups"], "decoded": sum(t["decoded"] for t in turns),
                    "prompt": [sum(t["prompt"][k] for t in turns) for k in (0, 1)],
                    "cached": [sum(t["cached"][k] for t in turns) for k in (0, 1)]})
    await client.close()
    return out


async def auto_calls(url: str, model: str, n: int) -> tuple[int, int]:
    """Of n round-1 questions asked with `tool_choice` auto (greedy, full mode), how many
    the model answered with a call of a given tool, and how many in all with a call."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="auto", max_retries=0, timeout=600)
    got = await asyncio.gather(*(client.chat.completions.create(
        model=model, messages=question(a, i, 1, {}), tools=TOOLS, max_tokens=64, temperature=0,
        extra_body={"tokendance": {"mode": "full"}}) for i, a in enumerate(scenario.agents(n))))
    await client.close()
    calls = [c.choices[0].message.tool_calls or [] for c in got]
    names = {t["function"]["name"] for t in TOOLS}
    return sum(bool(c) and all(x.function.name in names for x in c) for c in calls), sum(bool(c) for c in calls)


def main(args: argparse.Namespace) -> int:
    from tokendance.backend.service import EngineBackend
    from tokendance.examples.local import threaded

    be = EngineBackend.load(args.model, dtype=args.dtype, mode="full", offload_bytes=args.offload_gib << 30,
                            **reuse_options(args))
    cfg = be.engine.cfg  # the reuse policy as the engine resolved it (min_shared: its device's default)
    print(f"model {be.info.name}, {args.dtype}; {args.rounds} rounds, answers of {args.max_tokens} tokens; "
          f"host tier {args.offload_gib} GiB; recompute ratio {cfg.recompute_ratio}, {cfg.bases} bases, "
          f"shared segments reused from {be.engine.min_shared} tokens; medians of {args.repeats}")
    print("| agents | mode | round | ms | / full | groups | decoded | cached / prompt tokens: calls | answers |")
    print("|---|---|---|---|---|---|---|---|---|")
    with threaded(be, barrier_timeout=30.0) as url:
        for n in args.agents:
            runs: dict[str, list[list[dict]]] = {m: [] for m in MODES}
            for rep in range(args.repeats + 1):  # the first pass warms up
                for mode in MODES:
                    got = asyncio.run(simulate(url, be.info.name, n, args.rounds, mode, f"k{n}-{rep}-{mode}",
                                               args.max_tokens))
                    if rep:
                        runs[mode].append(got)
            for mode in MODES:
                for r in range(args.rounds):
                    ms = statistics.median(x[r]["ms"] for x in runs[mode])
                    ratio = statistics.median(x[r]["ms"] / f[r]["ms"] for x, f in zip(runs[mode], runs["full"]))
                    last = runs[mode][-1][r]
                    share = " | ".join(f"{c:,} / {p:,} ({c / p:.0%})" for c, p in zip(last["cached"], last["prompt"]))
                    print(f"| {n} | {mode} | {r + 1} | {ms:,.0f} | {ratio:.2f}x | {last['groups']} | "
                          f"{last['decoded']:,} | {share} |")
        n = max(args.agents)
        good, made = asyncio.run(auto_calls(url, be.info.name, n))
        print(f"tool_choice auto: {made} of {n} round-1 questions answered with a call, {good} naming given tools")
    return 0
