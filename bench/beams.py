"""What a beam search costs: vLLM's `use_beam_search` through the proxy (proxy/beams.py: a
one-token request per beam and step, to the engine in-process) against HF transformers'
`generate(num_beams=n)` on the same weights, and against n greedy sequences of the same
length through the proxy.

    tokendance bench beams [--model PATH] [--width 4] [--tokens 32] [--repeats 5]

The prompt is a chat turn in the model's template. No beam may end (`ignore_eos`, HF's
`min_new_tokens`): both searches then run every step and rank alike, so their beams are
compared token for token. Each variant once per repeat, in turn, after a warm-up round;
medians in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from tokendance.bench.options import positive
from tokendance.proxy.beams import MAX_WIDTH

ASK = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or GGUF (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--width", type=int, default=4, choices=range(1, MAX_WIDTH + 1), metavar=f"1-{MAX_WIDTH}",
                   help="beams: the request's n")
    p.add_argument("--tokens", type=positive, default=32, help="tokens each beam generates")
    p.add_argument("--repeats", type=positive, default=5)


def main(args: argparse.Namespace) -> int:
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    import httpx

    from tokendance.bench.engine import hf_model
    from tokendance.examples.local import backend, proxy

    be = backend(args.model, "prefix", dtype=args.dtype)
    eng = be.engine
    ids = eng.tokenizer(be.render_chat([{"role": "user", "content": ASK}]), add_special_tokens=False)["input_ids"]
    hf = hf_model(eng.folder, eng.dtype, torch.device(eng.device), False)
    x = torch.tensor([ids], device=eng.device)
    body = {"model": be.info.name, "prompt": ids, "n": args.width, "max_tokens": args.tokens, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}

    def theirs() -> list[list[int]]:
        with torch.inference_mode():
            out = hf.generate(x, num_beams=args.width, num_return_sequences=args.width, do_sample=False,
                              max_new_tokens=args.tokens, min_new_tokens=args.tokens, length_penalty=1.0)
        return [row[len(ids):].tolist() for row in out]

    async with proxy(be) as url, httpx.AsyncClient(timeout=3600) as http:
        async def ours(beam: bool) -> list[list[int]]:
            r = await http.post(url + "/completions", json={**body, "use_beam_search": beam})
            r.raise_for_status()
            return [c["token_ids"] for c in r.json()["choices"]]

        times: dict[str, list[float]] = {"beams": [], "hf": [], "greedy": []}
        got = want = []
        for r in range(args.repeats + 1):  # the first, a warm-up, is not counted
            t0 = time.perf_counter()
            got = await ours(True)
            t1 = time.perf_counter()
            want = theirs()
            t2 = time.perf_counter()
            await ours(False)
            t3 = time.perf_counter()
            if r:
                for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                    times[k].append(v)
    await be.close()
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    same = sum(a == b for a, b in zip(got, want))
    print(f"beam width {args.width}, {args.tokens} tokens after a {len(ids)}-token prompt, {be.info.name} "
          f"{eng.device} {eng.dtype}, medians of {args.repeats}:")
    print(f"  beam search (proxy)      {ms['beams']:9.1f} ms")
    print(f"  HF generate(num_beams)   {ms['hf']:9.1f} ms  (ours / HF {ms['beams'] / ms['hf']:.2f}x)")
    print(f"  {args.width:>2} greedy sequences    {ms['greedy']:9.1f} ms  "
          f"(beam search / greedy {ms['beams'] / ms['greedy']:.2f}x)")
    print(f"  beams equal to HF's, token for token and in order: {same}/{args.width}")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p)
    raise SystemExit(main(p.parse_args()))
