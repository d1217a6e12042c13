"""What n-gram speculation (`--speculative-config`, backend/speculate.py) saves a debate:
the same simulation on an engine that drafts and on one that does not.

    tokendance bench speculate [--model PATH] [--dtype float32] [--agents 8] [--rounds 3]
                               [--max-tokens 256] [--tokens 2,4] [--lookup-min 2]
                               [--lookup-max 4] [--repeats 3]

`bench loops`' debate (examples/debate.py, every round's prompts in one batch, greedy,
`full`), answers fed back as the debate feeds them. One engine without speculation and
one per `--tokens` (num_speculative_tokens), the runs alternating; medians of the times.
Per engine: tokens generated, engine steps, drafted and accepted tokens, the answers that
equal the plain engine's (greedy decoding with drafts computes a step's rows in one
product: float rounding may flip a near tie, after which an answer, and the rounds that
read it, differ), wall time and its ratio to the plain engine's.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

from tokendance.bench.loops import add_debate_args, simulate
from tokendance.bench.options import counts, positive


def add_args(p: argparse.ArgumentParser) -> None:
    add_debate_args(p)
    p.add_argument("--tokens", type=counts, default=[2, 4], help="num_speculative_tokens, one engine each")
    p.add_argument("--lookup-min", type=positive, default=2, help="prompt_lookup_min")
    p.add_argument("--lookup-max", type=positive, default=4, help="prompt_lookup_max")


class Counted:
    """A function counting its calls (the engine's steps)."""

    def __init__(self, f: Callable[[], Any]):
        self.f, self.n = f, 0

    def __call__(self) -> Any:
        self.n += 1
        return self.f()


def drafted(eng: Any) -> tuple[int, int, int]:
    """The engine's drafts, drafted tokens and accepted ones so far."""
    s = eng.speculator
    return (s.drafts, s.draft_tokens, s.accepted) if s is not None else (0, 0, 0)


def main(args: argparse.Namespace) -> int:
    from tokendance.backend.api import SamplingParams
    from tokendance.backend.engine import Engine

    if args.lookup_min > args.lookup_max:
        raise ValueError("--lookup-min must not be over --lookup-max")
    specs = {"off": None} | {f"{k} tokens": {"method": "ngram", "num_speculative_tokens": k,
                                             "prompt_lookup_min": args.lookup_min,
                                             "prompt_lookup_max": args.lookup_max} for k in args.tokens}
    engines = {name: Engine(model=args.model, dtype=args.dtype, kv_tokens=16384, speculative_config=spec)
               for name, spec in specs.items()}
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    warm = argparse.Namespace(**{**vars(args), "rounds": 1})
    for eng in engines.values():
        simulate(eng, warm, sampling)
    times: dict[str, list[float]] = {k: [] for k in engines}
    out: dict[str, list] = {}
    steps: dict[str, int] = {}
    counted: dict[str, tuple[int, ...]] = {}
    for _ in range(args.repeats):
        for name, eng in engines.items():
            eng.reset_caches()
            before, calls = drafted(eng), Counted(eng.step)
            eng.step = calls
            t, out[name] = simulate(eng, args, sampling)
            del eng.step
            times[name].append(t)
            steps[name] = calls.n
            counted[name] = tuple(a - b for a, b in zip(drafted(eng), before))
    eng = engines["off"]
    print(f"debate of {args.agents} agents, {args.rounds} rounds, max_tokens {args.max_tokens}, greedy, n-grams of "
          f"{args.lookup_min}-{args.lookup_max} tokens, {eng.device} {eng.dtype}, medians of {args.repeats}:")
    print("| speculation | tokens | steps | drafts | drafted tokens | accepted | answers as without | time | "
          "vs without |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = statistics.median(times["off"])
    plain = [x for r in out["off"] for x in r]
    for name in engines:
        answers = [x for r in out[name] for x in r]
        same = sum(a == b for a, b in zip(answers, plain))
        drafts, tokens, accepted = counted[name]
        rate = f" ({accepted / tokens:.0%})" if tokens else ""
        t = statistics.median(times[name])
        print(f"| {name} | {sum(len(ids) for ids, _ in answers):,} | {steps[name]:,} | {drafts:,} | {tokens:,} | "
              f"{accepted:,}{rate} | {same}/{len(plain)} | {t:.1f} s | {base / t:.2f}x |")
    return 0
