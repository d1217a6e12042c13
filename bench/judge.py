"""A judge reading a round: N agents' answers scored by a label's probability, in one
`/generative_scoring` call against one completion per answer.

    tokendance bench judge [--model PATH] [--dtype float32] [--items 16] [--words 48]
                           [--repeats 5]

The proxy and the engine run in this process (the default reuse mode). Each of `items`
answers (`words` words of a fixed vocabulary, seeded) follows a shared query (what a
judge asks of every answer) and is scored by the probability of " Yes" against " No"
as the next token. Three ways to get the same scores (checked on one set of answers),
then timed in turn each repeat, each run on answers not seen before (the query's blocks
are in the prefix cache after the first call, as a judge's repeated question's are):
`scoring`, one /generative_scoring call with every answer; `serial`, one
/v1/completions call per answer (max_tokens 1, logprob_token_ids), each awaited before
the next, as a judge loop in an agent framework sends them; `concurrent`, the same
completions all at once. The scores of the three must agree (to 1e-3); medians in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time

from tokendance.bench.options import positive

QUERY = ("You judge a debate. The question was: which river is the longest? Read the answer below and say "
         "whether it is right. Reply Yes or No.\nAnswer:")
WORDS = ("the Nile runs north through Egypt and is longer than the Amazon by some counts while others measure "
         "the Amazon from a farther source in Peru so its basin and flow are the largest on earth").split()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or GGUF (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--items", type=positive, default=16, help="answers to score")
    p.add_argument("--words", type=positive, default=48, help="words per answer")
    p.add_argument("--repeats", type=positive, default=5)


def main(args: argparse.Namespace) -> int:
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    import httpx

    from tokendance.examples.local import backend, proxy

    be = backend(args.model, None, dtype=args.dtype)
    rng = random.Random(0)

    def fresh() -> list[str]:
        return [" " + " ".join(rng.choice(WORDS) for _ in range(args.words)) for _ in range(args.items)]

    tok = be.tokenizer
    labels = [tok.encode(" Yes", add_special_tokens=False)[0], tok.encode(" No", add_special_tokens=False)[0]]
    query = tok.encode(QUERY)
    name = be.info.name
    async with proxy(be) as url, httpx.AsyncClient(timeout=600) as http:
        base = url.removesuffix("/v1")

        async def scoring(items: list[str]) -> list[float]:
            r = await http.post(base + "/generative_scoring", json={
                "model": name, "query": QUERY, "items": items, "label_token_ids": labels})
            r.raise_for_status()
            return [d["score"] for d in r.json()["data"]]

        async def one(item: str) -> float:
            ids = query + tok.encode(item, add_special_tokens=False)
            r = await http.post(url + "/completions", json={
                "model": name, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                "logprob_token_ids": labels})
            r.raise_for_status()
            top = r.json()["choices"][0]["logprobs"]["top_logprobs"][0]
            yes, no = (top[tok.decode([t])] for t in labels)
            return 1 / (1 + math.exp(no - yes))

        async def serial(items: list[str]) -> list[float]:
            return [await one(x) for x in items]

        async def concurrent(items: list[str]) -> list[float]:
            return list(await asyncio.gather(*(one(x) for x in items)))

        runs = {"scoring": scoring, "serial": serial, "concurrent": concurrent}
        items = fresh()
        ref = await scoring(items)  # warm-up, and the scores the others must give
        for fn in (serial, concurrent):
            got = await fn(items)
            if max(abs(a - b) for a, b in zip(got, ref)) > 1e-3:
                raise SystemExit(f"{fn.__name__} scores differ from scoring's: {got[:3]} vs {ref[:3]}")
        ms: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.repeats):
            for k, fn in runs.items():
                items = fresh()  # answers not seen before: only the query's blocks are cached
                t = time.perf_counter()
                await fn(items)
                ms[k].append((time.perf_counter() - t) * 1e3)
    med = {k: statistics.median(v) for k, v in ms.items()}
    prompt = len(query) + sum(len(tok.encode(x, add_special_tokens=False)) for x in items) / len(items)
    print(f"{args.items} answers of ~{prompt:.0f} prompt tokens, {be.info.name}, medians of {args.repeats} (ms):")
    for k, v in med.items():
        print(f"  {k:<11} {v:9.1f}  {args.items / v * 1e3:7.1f} answers/s  "
              f"{med['serial'] / v:5.2f}x serial  {med['concurrent'] / v:5.2f}x concurrent")
    return 0
