"""What tokenizing a segmented prompt whole costs against tokenizing each segment alone.

    python -m tokendance.bench.prompt [--agents 20] [--words 150] [--repeats 21]

A round prompt of the main job's shape: a private history, then every agent's answer
after "AgentN answered:", each answer a shared segment. Whole: `backend/prompt.py`'s
tokenize (one call with character offsets); apart: one encode per segment (what the
backend did before session 22); rust: the tokenizers library alone on the whole text.
Medians of `repeats` calls each, taken in turn, in ms, on the embedded model's tokenizer.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from tokendance.backend import loader
from tokendance.backend.api import Segment
from tokendance.backend.prompt import tokenize
from tokendance.bench.options import positive

WORDS = "the sky is blue because of Rayleigh scattering and a tomato is a fruit botanically speaking".split()


def segments(agents: int, words: int, seed: int = 0) -> list[Segment]:
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    out = [Segment(text(500))]
    for i in range(agents):
        out += [Segment(f"\n\nAgent{i} answered:\n"), Segment(text(words).capitalize() + ".", shared=True)]
    return out


def medians_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each function once per repeat, in turn (a noisy CPU drifts alike for all)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=positive, default=20)
    ap.add_argument("--words", type=positive, default=150)
    ap.add_argument("--repeats", type=positive, default=21)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(loader.resolve(None))
    segs = segments(args.agents, args.words)
    text = "".join(s.text for s in segs)
    ids, _ = tokenize(tok, segs)
    rows = {
        "whole": lambda: tokenize(tok, segs),
        "apart": lambda: [tok.encode(s.text, add_special_tokens=False) for s in segs],
        "rust": lambda: tok.backend_tokenizer.encode(text, add_special_tokens=False),
    }
    print(f"{len(ids)} tokens, {len(segs)} segments, medians of {args.repeats}")
    print("| tokenize | ms |\n|---|---|")
    for name, ms in medians_ms(rows, args.repeats).items():
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()
