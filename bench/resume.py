"""`tokendance bench resume`: the second round of an All-Gather simulation, its agents
resumed from the host tier against the same round prefilled without it.

Round 1 (bench/allgather.py) runs in `collective` mode, each agent answering `--answer`
tokens; round 2's prompt of agent i is its round-1 prompt, its answer, and every agent's
new output. Resumed: round 1's requests named their agents, so round 2 restores each
agent's parked prefix (backend/idle.py: Masters once, private slots, one fused restore)
and prefills only the rest. Without: the same rounds with no agent named, so round 2
reuses the shared blocks but prefills every agent's history and answer. Both start from
cold caches and run round 1 first; round 2's prefill (to its first tokens) is timed,
median of repeats.

    tokendance bench resume --agents 4,8 --history 256 --output 100
"""

from __future__ import annotations

import argparse
import statistics

from tokendance.backend.api import SamplingParams
from tokendance.bench.allgather import make_round, next_round
from tokendance.bench.options import counts, natural, positive
from tokendance.bench.reuse import play
from tokendance.bench.shapes import round_engine


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf, or a shape name (qwen2.5-7b)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--agents", type=counts, default="4,8", help="N, comma list")
    p.add_argument("--history", type=natural, default=256)
    p.add_argument("--output", type=natural, default=100)
    p.add_argument("--answer", type=positive, default=32, help="tokens each agent answers in round 1")
    p.add_argument("--repeats", type=positive, default=3)


def main(args: argparse.Namespace) -> int:
    agents = args.agents
    n = max(agents)
    eng, vocab = round_engine(args.model, args.dtype, n * 2 * (args.history + 2 * n * args.output
                                                              + args.answer) + 8192)
    print(f"model {eng.name} on {eng.device}, {eng.dtype}; histories ~{args.history}, outputs "
          f"~{args.output}, answers {args.answer}; round 2 prefill, median of {args.repeats}")
    print("| N | round-2 prompt tokens | resumed ms | without ms | speed-up | computed resumed / without "
          "| restored tokens |\n|---|---|---|---|---|---|---|")
    for k in agents:
        r1 = make_round(k, args.history, args.output, vocab, seed=k)
        res = {True: [], False: []}
        for rep in range(args.repeats + 1):  # the first pass warms up
            for resumed in (True, False):
                eng.reset_caches()
                first = play(eng, r1, "collective", greedy(args.answer), f"{rep}{resumed}a", resumed)
                r2 = next_round(r1, first.answers, args.output, vocab, seed=100 + k)
                restored = eng.idle.restored
                second = play(eng, r2, "collective", greedy(1), f"{rep}{resumed}b", resumed)
                if rep:
                    res[resumed].append((second.seconds, second.computed, eng.idle.restored - restored))
        t = {r: statistics.median(x[0] for x in v) for r, v in res.items()}
        w = {r: v[-1][1] for r, v in res.items()}
        print(f"| {k} | {r2.prompt_tokens} | {1e3 * t[True]:.0f} | {1e3 * t[False]:.0f} | "
              f"{t[False] / t[True]:.2f}x | {w[True]:.0f} / {w[False]:.0f} | {res[True][-1][2]} |",
              flush=True)
    eng.reset_caches()
    return 0
