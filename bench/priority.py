"""What `--scheduling-policy priority` gives an urgent request in a busy engine: the
same load under fcfs and under priority.

    tokendance bench priority [--model PATH] [--dtype float32] [--background 16]
                              [--max-num-seqs 8] [--prompt 64] [--tokens 48]
                              [--urgent-tokens 16] [--repeats 3]

`background` requests (random prompts of `prompt` tokens, `tokens` greedy tokens each)
fill an engine of `max-num-seqs` running slots; once the first slots decode, one urgent
request (priority -1 under the priority policy; a plain request under fcfs) arrives.
Per policy: the steps and the time from its arrival to its last token, the time to
finish everything (what the preempted requests' recomputation costs), and the
preemptions. The policies alternate in one process, each with an engine of its own;
medians of the times.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokendance.backend.api import POLICIES, SamplingParams
from tokendance.backend.engine import Engine
from tokendance.bench.engine import rand_prompts
from tokendance.bench.options import positive


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or GGUF (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--background", type=positive, default=16, help="requests already there")
    p.add_argument("--max-num-seqs", type=positive, default=8, help="the engine's running slots")
    p.add_argument("--prompt", type=positive, default=64, help="prompt tokens of each request")
    p.add_argument("--tokens", type=positive, default=48, help="tokens each background request generates")
    p.add_argument("--urgent-tokens", type=positive, default=16, help="tokens the urgent request generates")
    p.add_argument("--repeats", type=positive, default=3)


def once(eng: Engine, args: argparse.Namespace, policy: str, seed: int) -> dict:
    """One run of the load; the urgent request's steps and ms, everything's ms, preemptions."""
    vocab = min(eng.mcfg.vocab_size, len(eng.tokenizer))
    *rest, urgent = rand_prompts(args.background + 1, args.prompt, vocab, seed)
    slow = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    fast = SamplingParams(max_tokens=args.urgent_tokens, temperature=0, ignore_eos=True,
                          priority=-1 if policy == "priority" else 0)
    preempted = eng.scheduler.preemptions  # the engine's count, over every run
    for i, p in enumerate(rest):
        eng.add(f"bg{i}", p, slow)
    t0 = time.perf_counter()
    while not any(s.out for s in eng.seqs.values()):  # the first slots decode
        eng.step()
    eng.add("urgent", urgent, fast)
    arrived, steps, urgent_ms = time.perf_counter(), 0, None
    while eng.has_work():
        finished = [rid for rid, d in eng.step() if d.finish_reason]
        steps += urgent_ms is None
        if "urgent" in finished:
            urgent_ms = (time.perf_counter() - arrived) * 1e3
    return dict(steps=steps, urgent=urgent_ms, total=(time.perf_counter() - t0) * 1e3,
                preemptions=eng.scheduler.preemptions - preempted)


def main(args: argparse.Namespace) -> int:
    engines = {p: Engine(model=args.model, dtype=args.dtype, kv_tokens=16384, max_seqs=args.max_num_seqs,
                         scheduling_policy=p) for p in POLICIES}
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for rep in range(args.repeats + 1):  # the first pass warms up
        for p in POLICIES:
            got = once(engines[p], args, p, seed=rep)
            if rep:
                runs[p].append(got)
    name = engines["fcfs"].name
    print(f"model {name}, {args.dtype}; {args.background} requests of {args.prompt} + {args.tokens} tokens "
          f"in {args.max_num_seqs} slots, then one urgent of {args.urgent_tokens}; medians of {args.repeats}")
    print("| policy | urgent: steps | urgent: ms | all done: ms | preemptions |\n|---|---|---|---|---|")
    med = {p: {k: statistics.median(r[k] for r in runs[p]) for k in runs[p][0]} for p in POLICIES}
    for p in POLICIES:
        m = med[p]
        print(f"| {p} | {m['steps']:.0f} | {m['urgent']:.0f} | {m['total']:.0f} | {m['preemptions']:.0f} |")
    f, q = med["fcfs"], med["priority"]
    print(f"urgent request's latency, priority / fcfs: {q['urgent'] / f['urgent']:.2f}x; "
          f"everything: {q['total'] / f['total']:.2f}x")
    return 0
