"""What repetition detection saves a debate: the same simulation with vLLM's
repetition_detection and without.

    tokendance bench loops [--model PATH] [--dtype float32] [--agents 8] [--rounds 3]
                           [--max-tokens 256] [--pattern 32] [--count 3] [--repeats 3]

`examples/debate.py`'s debate, every round's prompts run by the engine in one batch
(greedy, `full`), answers fed back as the debate feeds them. With detection, an answer
ends once it ends in a pattern of 1 to `pattern` tokens repeated `count` times. Greedy
decoding takes the same path until a loop is found, so each round-1 answer with
detection is a prefix of the one without (checked); later rounds read shorter answers
and differ. Per run: tokens generated, answers ended by a loop or by max_tokens, wall
time; the two runs alternate, medians of the times.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokendance.backend.prompt import render_chat
from tokendance.bench.options import positive


def add_debate_args(p: argparse.ArgumentParser) -> None:
    """The debate `simulate` runs, and the runs."""
    p.add_argument("--model", default=None, help="HF folder or GGUF (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--agents", type=positive, default=8)
    p.add_argument("--rounds", type=positive, default=3)
    p.add_argument("--max-tokens", type=positive, default=256)
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--seed", type=int, default=0, help="picks the question")


def add_args(p: argparse.ArgumentParser) -> None:
    add_debate_args(p)
    p.add_argument("--pattern", type=positive, default=32, help="max_pattern_size")
    p.add_argument("--count", type=int, default=3, help="min_count (at least 2)")


def simulate(engine, args: argparse.Namespace, sampling) -> tuple[float, list[list[tuple[list[int], str]]]]:
    """(seconds, per round each agent's (token ids, finish reason))."""
    from tokendance.examples.debate import Debate

    d = Debate(args.agents, args.seed)
    rounds = []
    t = time.perf_counter()
    for r in range(args.rounds):
        prompts = [engine.encode(render_chat(engine.tokenizer, d.messages(a, r))) for a in d.agents]
        got = engine.generate(prompts, sampling)
        rounds.append([(ids, reason) for ids, _, reason in got])
        d.observe(r, {a: text.strip() for a, (_, text, _) in zip(d.agents, got)})
    return time.perf_counter() - t, rounds


def main(args: argparse.Namespace) -> int:
    from tokendance.backend.api import Repetition, SamplingParams
    from tokendance.backend.engine import Engine

    engine = Engine(model=args.model, dtype=args.dtype, kv_tokens=16384)
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    loops = SamplingParams(max_tokens=args.max_tokens, temperature=0,
                           repetition=Repetition(args.pattern, 1, args.count))
    loops.validate()
    runs = {"without": plain, "with": loops}
    times: dict[str, list[float]] = {k: [] for k in runs}
    out: dict[str, list] = {}
    simulate(engine, argparse.Namespace(**{**vars(args), "rounds": 1}), plain)  # warm-up
    for _ in range(args.repeats):
        for k, sp in runs.items():
            engine.reset_caches()
            s, out[k] = simulate(engine, args, sp)
            times[k].append(s)
    for (a, _), (b, _) in zip(out["with"][0], out["without"][0]):
        if b[:len(a)] != a:
            raise SystemExit("a round-1 answer with detection is not a prefix of the one without")
    print(f"debate of {args.agents} agents, {args.rounds} rounds, max_tokens {args.max_tokens}, patterns of 1-"
          f"{args.pattern} tokens {args.count} times, {engine.device} {engine.dtype}, medians of {args.repeats}:")
    print("| detection | tokens | ended by a loop | by max_tokens | by EOS or stop | time |")
    print("|---|---|---|---|---|---|")
    for k in runs:
        answers = [x for r in out[k] for x in r]
        n = {why: sum(reason == why for _, reason in answers) for why in ("repetition", "length", "stop")}
        print(f"| {k} | {sum(len(ids) for ids, _ in answers):,} | {n['repetition']} | {n['length']} | {n['stop']} "
              f"| {statistics.median(times[k]):.1f} s |")
    ratio = statistics.median(times["without"]) / statistics.median(times["with"])
    print(f"with detection the debate runs {ratio:.2f}x as fast")
    return 0
