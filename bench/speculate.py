"""What n-gram speculation (`--speculative-config`, backend/speculate.py) saves a debate:
the same simulation on an engine that drafts and on one that does not; and what a step
with drafts costs against a decode step.

    tokendance bench speculate [--model PATH|SHAPE] [--dtype float32] [--agents 8] [--rounds 3]
                               [--max-tokens 256] [--tokens 2,4] [--lookup-min 2]
                               [--lookup-max 4] [--repeats 3] [--cost 8x512,...] [--no-debate]

`bench loops`' debate (examples/debate.py, every round's prompts in one batch, greedy,
`full`), answers fed back as the debate feeds them. One engine without speculation and
one per `--tokens` (num_speculative_tokens), the runs alternating; medians of the times.
Per engine: tokens generated, engine steps, drafted and accepted tokens, the answers that
equal the plain engine's (greedy decoding with drafts computes a step's rows in one
product: float rounding may flip a near tie, after which an answer, and the rounds that
read it, differ), wall time, and tokens a second against the plain engine's (the ratio of
times when greedy answers are the same; `--temperature` samples, and answers differ).

`--cost BxL`: one step of B sequences at L tokens of context (random prompts), each
feeding its last token and k drafts, for k from 0 (a decode step: on CUDA a graph's) to
the largest `--tokens`; medians of `--repeats` x 5 after a warm-up. A step of k drafts
pays off once it keeps more than cost(k) / cost(0) - 1 of them on average. With a shape
name as `--model` (random weights: bench/shapes.py), `--no-debate` runs the costs alone.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

from tokendance.backend.api import SamplingParams
from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine
from tokendance.backend.scheduler import Scheduled
from tokendance.bench.engine import rand_prompts, timed
from tokendance.bench.loops import add_debate_args, simulate
from tokendance.bench.options import batches, counts, positive
from tokendance.bench.shapes import resolve


def add_args(p: argparse.ArgumentParser) -> None:
    add_debate_args(p)
    p.add_argument("--tokens", type=counts, default=[2, 4], help="num_speculative_tokens, one engine each")
    p.add_argument("--lookup-min", type=positive, default=2, help="prompt_lookup_min")
    p.add_argument("--lookup-max", type=positive, default=4, help="prompt_lookup_max")
    p.add_argument("--cost", type=batches, default=[], metavar="BxL,...",
                   help="also time a step of B sequences at L tokens with 0 to max(--tokens) drafts each")
    p.add_argument("--debate", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the debate's sampling (0: greedy; above, answers differ run to run: compare tokens/s)")


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
    if args.lookup_min > args.lookup_max:
        raise ValueError("--lookup-min must not be over --lookup-max")
    if not args.debate and not args.cost:
        raise ValueError("nothing to run: --no-debate without --cost")
    folder, random = resolve(args.model)
    if args.debate:
        debate(args, folder, random)
    if args.cost:
        costs(args, folder, random)
    return 0


def debate(args: argparse.Namespace, folder: str | None, random: bool) -> None:
    specs = {"off": None} | {f"{k} tokens": {"method": "ngram", "num_speculative_tokens": k,
                                             "prompt_lookup_min": args.lookup_min,
                                             "prompt_lookup_max": args.lookup_max} for k in args.tokens}
    engines = {name: engine(args, folder, random, 16384, speculative_config=spec) for name, spec in specs.items()}
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    sampling.validate()
    warm = argparse.Namespace(**{**vars(args), "rounds": 1})
    for eng in engines.values():
        simulate(eng, warm, sampling)
    times: dict[str, list[float]] = {k: [] for k in engines}
    rates: dict[str, list[float]] = {k: [] for k in engines}  # tokens a second, each run's
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
            rates[name].append(sum(len(ids) for r in out[name] for ids, _ in r) / t)
            steps[name] = calls.n
            counted[name] = tuple(a - b for a, b in zip(drafted(eng), before))
    eng = engines["off"]
    how = "greedy" if sampling.greedy else f"temperature {args.temperature}"
    print(f"debate of {args.agents} agents, {args.rounds} rounds, max_tokens {args.max_tokens}, {how}, n-grams of "
          f"{args.lookup_min}-{args.lookup_max} tokens, {eng.device} {eng.dtype}, medians of {args.repeats} "
          "(the counts: the last run's):")
    print("| speculation | tokens | steps | drafts | drafted tokens | accepted | answers as without | time | "
          "tokens/s vs without |")
    print("|---|---|---|---|---|---|---|---|---|")
    plain = [x for r in out["off"] for x in r]
    rate = {name: statistics.median(r) for name, r in rates.items()}
    for name in engines:
        answers = [x for r in out[name] for x in r]
        same = sum(a == b for a, b in zip(answers, plain))
        drafts, tokens, accepted = counted[name]
        kept = f" ({accepted / tokens:.0%})" if tokens else ""
        print(f"| {name} | {sum(len(ids) for ids, _ in answers):,} | {steps[name]:,} | {drafts:,} | {tokens:,} | "
              f"{accepted:,}{kept} | {same}/{len(plain)} | {statistics.median(times[name]):.1f} s | "
              f"{rate[name] / rate['off']:.2f}x |")


def engine(args: argparse.Namespace, folder: str | None, random: bool, kv_tokens: int, **cfg: Any) -> Engine:
    return Engine(EngineConfig(model=folder, dtype=args.dtype, random_weights=random, kv_tokens=kv_tokens, **cfg))


def costs(args: argparse.Namespace, folder: str | None, random: bool) -> None:
    """The `--cost` table: a step's time by drafts a sequence (the module's docstring)."""
    ks = range(max(args.tokens) + 1)
    tokens = max(b * (l + 2 * len(ks) + 16) for b, l in args.cost)
    eng = engine(args, folder, random, max(tokens, 16384), overlap=False, max_batched_tokens=16384)
    vocab = min(eng.mcfg.vocab_size, len(eng.tokenizer))
    print(f"a step of B sequences at L tokens, each with k drafts: ms ({eng.device} {eng.dtype}, "
          f"medians of {5 * args.repeats}; x: of a decode step's time)")
    print("| B x L | " + " | ".join(f"{k} draft{'s' * (k != 1)}" for k in ks) + " |")
    print("|---|" + "---|" * len(ks))
    sp = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    for b, l in args.cost:
        for i, p in enumerate(rand_prompts(b, l, vocab, seed=b + l)):
            eng.add(f"cost-{i}", p, sp)
        while not all(s.out for s in eng.seqs.values()):  # prefilled: each decodes next
            eng.step()
        seqs = list(eng.scheduler.running)
        if len(seqs) != b:
            raise ValueError(f"--cost {b}x{l}: {len(seqs)} of the {b} sequences run at once")
        ms = []
        for k in ks:
            for s in seqs:
                s.draft = [s.out[-1]] * k  # the tokens do not change the time
                if not eng.blocks.reserve(s, len(s) + k):
                    raise ValueError(f"--cost {b}x{l}: the pool holds too few tokens")
            work = [Scheduled(s, s.computed, 1 + k) for s in seqs]
            timed(lambda: eng.runner.run(work), eng.device)
            ms.append(1000 * statistics.median(timed(lambda: eng.runner.run(work), eng.device)
                                               for _ in range(5 * args.repeats)))
        for s in seqs:
            s.draft = []
            eng.abort(s.id)
        eng.reset_caches()
        print(f"| {b} x {l} | {ms[0]:.2f} | " + " | ".join(f"{t:.2f} ({t / ms[0]:.2f}x)" for t in ms[1:]) + " |")
