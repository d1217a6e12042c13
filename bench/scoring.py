"""What scoring a prompt costs: a prefill with prompt logprobs against the same prefill
without them.

    python -m tokendance.bench.scoring [--model PATH] [--tokens 512] [--prompts 4]
                                       [--top 5] [--repeats 11]

`prompts` random prompts of `tokens` tokens each, prefilled to their first token
(max_tokens 1) in `full`; scored: with SamplingParams.prompt_logprobs = `top` (what
`echo` with `logprobs` asks for: backend/scoring.py). The engine's startup heap is frozen
for Python's garbage collector while they run, as `serve` freezes it (backend/heap.py).
Each variant once per repeat, in turn; medians in ms, and scored / plain.
"""

from __future__ import annotations

import argparse

import torch

from tokendance.backend import heap
from tokendance.backend.api import SamplingParams
from tokendance.bench.options import positive
from tokendance.bench.prompt import medians_ms
from tokendance.bench.shapes import resolve


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="HF folder, .gguf, or a shape name with random weights (qwen2.5-7b); default: SmolLM2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=positive, default=512)
    ap.add_argument("--prompts", type=positive, default=4)
    ap.add_argument("--top", type=int, default=5, choices=range(21), metavar="0-20")
    ap.add_argument("--repeats", type=positive, default=11)
    args = ap.parse_args(argv)
    from tokendance.backend.config import EngineConfig
    from tokendance.backend.engine import Engine

    model, random = resolve(args.model)
    eng = Engine(EngineConfig(model=model, dtype=args.dtype, random_weights=random,
                              kv_tokens=max(4096, 2 * args.prompts * (args.tokens + 16)),
                              max_batched_tokens=args.prompts * args.tokens))
    vocab = min(eng.mcfg.vocab_size, len(eng.tokenizer))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.tokens,), generator=g).tolist()
               for _ in range(args.prompts)]
    plain = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=args.top)
    run = {"plain": lambda: eng.generate(prompts, plain), "scored": lambda: eng.generate(prompts, scored)}
    with heap.frozen():  # as `serve` serves
        for fn in run.values():  # warm-up
            fn()
        ms = medians_ms(run, args.repeats)
    ratio = ms["scored"] / ms["plain"]
    print(f"{args.prompts} x {args.tokens} tokens, top {args.top}, {eng.device} {eng.dtype}, "
          f"vocabulary {eng.mcfg.vocab_size}, medians of {args.repeats}:")
    print(f"  plain prefill  {ms['plain']:9.1f} ms")
    print(f"  scored prefill {ms['scored']:9.1f} ms  ({ratio:.2f}x)")
    return {**ms, "ratio": ratio}


if __name__ == "__main__":
    main()
