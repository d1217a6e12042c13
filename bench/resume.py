"""`tokendance bench resume`: the second round of an All-Gather simulation, its agents
resumed from the host tier against the same round prefilled without it.

Round 1 (bench/allgather.py) runs first, each agent answering `--answer` tokens; round
2's prompt of agent i is its round-1 prompt, its answer, and every agent's new output.
Resumed (both rounds `collective`): round 1's requests named their agents, so round 2
restores each agent's parked prefix (backend/idle.py: Masters once, private slots, one
fused restore) and prefills only the rest. Without: the same rounds with no agent named,
so round 2 reuses the shared blocks but prefills every agent's history and answer.
Prefix: both rounds in `prefix` mode, what vLLM does: round 2 finds each agent's round-1
prompt and answer in the block cache and prefills the new outputs at their offsets.
kvcomm (`--variants` adds it): both rounds `kvcomm`, agents named: round 1 is prefilled
exactly and measures each agent's places, round 2 restores each agent's parked prefix
and reads the new outputs at their base plus the offsets predicted there; kvcmas the
same over low-rank anchors (its round-1 answers published, though round 2's new outputs
are not any agent's: their bases are prefilled standalone). Each starts
from cold caches and runs round 1 first; round 2's prefill (to its first tokens) is
timed, median of repeats, the variants taking turns; the first variant is compared with
each other.

With --dump-prompts FILE, each N's round 1 (prompts with their answers, what a prefix
cache holds after it) and round 2 prompts go to FILE, for the same second round served by
vLLM-CPU (bench/vllm_cpu.py; `ROUND=2 bench/vllm_baseline.sh`).

    tokendance bench resume --agents 4,8 --history 256 --output 100 --variants resumed,kvcomm
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from tokendance.backend.api import REUSE_DEFAULTS, SamplingParams
from tokendance.bench.allgather import make_round, next_round
from tokendance.bench.options import counts, names, natural, nonnegative, positive, share
from tokendance.bench.reuse import play
from tokendance.bench.shapes import round_engine


# variant: (mode of both rounds, whether requests name their agents)
VARIANTS = {"resumed": ("collective", True), "without": ("collective", False), "prefix": ("prefix", False),
            "kvcomm": ("kvcomm", True), "kvcmas": ("kvcmas", True)}


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
    p.add_argument("--ratio", type=share, default=REUSE_DEFAULTS["recompute_ratio"],
                   help="share of reused tokens recomputed")
    p.add_argument("--variants", type=names(tuple(VARIANTS), least=1), default="resumed,without,prefix",
                   help="comma list; the first is compared with each other")
    p.add_argument("--anchor-gib", type=nonnegative, default=16.0,
                   help="kvcomm's anchors: every agent's every segment keeps one (N x N of them)")
    p.add_argument("--offload-gib", type=nonnegative, default=None,
                   help="host memory for parked agents (default: the engine's, 8 GiB beside a GPU)")
    p.add_argument("--json", default=None, help="write rows here (a row per N and variant)")
    p.add_argument("--dump-prompts", default=None,
                   help="write each N's round 1 with its answers and round 2 (for vLLM)")


def main(args: argparse.Namespace) -> int:
    agents, variants = args.agents, list(dict.fromkeys(args.variants))
    if args.dump_prompts and "prefix" not in variants:
        raise ValueError("--dump-prompts writes the prefix variant's rounds: add prefix to --variants")
    n = max(agents)
    eng, vocab = round_engine(args.model, args.dtype, n * 2 * (args.history + 2 * n * args.output
                                                              + args.answer) + 8192,
                              recompute_ratio=args.ratio, anchor_bytes=int(args.anchor_gib * 2**30),
                              offload_bytes=None if args.offload_gib is None else int(args.offload_gib * 2**30))
    print(f"model {eng.name} on {eng.device}, {eng.dtype}; histories ~{args.history}, outputs "
          f"~{args.output}, answers {args.answer}, ratio {args.ratio}, host tier {eng.idle.tier.budget / 2**30:g} GiB; "
          f"round 2 prefill, median of {args.repeats}")
    lead, others = variants[0], variants[1:]
    cols = ([f"{v} ms" for v in variants] + [f"{lead} vs {v}" for v in others]
            + [f"computed {' / '.join(variants)}", f"restored {' / '.join(variants)}"])
    print("| N | round-2 prompt tokens | " + " | ".join(cols) + " |\n" + "|---" * (len(cols) + 2) + "|")
    rows, dumped = [], {}
    for k in agents:
        r1 = make_round(k, args.history, args.output, vocab, seed=k)
        res: dict[str, list[tuple[float, float, int]]] = {v: [] for v in variants}
        for rep in range(args.repeats + 1):  # the first pass warms up
            for v in variants:
                mode, named = VARIANTS[v]
                eng.reset_caches()
                first = play(eng, r1, mode, greedy(args.answer), f"{rep}{v}a", named)
                r2 = next_round(r1, first.answers, args.output, vocab, seed=100 + k)
                restored = eng.idle.restored
                second = play(eng, r2, mode, greedy(1), f"{rep}{v}b", named)
                if rep:
                    res[v].append((second.seconds, second.computed, eng.idle.restored - restored))
                if mode == "prefix":  # vLLM gets the exact answers and the round 2 built on them
                    dumped[k] = dict(before=[p + a for p, a in zip(r1.prompts, first.answers)],
                                     prompts=r2.prompts)
        t = {v: statistics.median(x[0] for x in runs) for v, runs in res.items()}
        work = {v: runs[-1][1] for v, runs in res.items()}
        print(f"| {k} | {r2.prompt_tokens} | " + " | ".join(f"{1e3 * t[v]:.0f}" for v in variants)
              + "".join(f" | {t[v] / t[lead]:.2f}x" for v in others) + " | "
              + " / ".join(f"{work[v]:.0f}" for v in variants) + " | "
              + " / ".join(str(res[v][-1][2]) for v in variants) + " |", flush=True)
        rows += [dict(agents=k, mode=v, round=2, max_tokens=1, ms=1e3 * t[v], prompt_tokens=r2.prompt_tokens,
                      computed=work[v], restored=runs[-1][2], all_ms=[round(1e3 * x[0], 1) for x in runs])
                 for v, runs in res.items()]
    eng.reset_caches()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.dump_prompts:
        Path(args.dump_prompts).write_text(json.dumps(dumped))
    return 0
