"""`tokendance bench parallel`: the engine split over 1, 2, ... devices (tensor
parallelism, backend/parallel.py), each size in turn in one run: prefill and decode
throughput, and one All-Gather round in full and collective mode (bench/reuse.py),
against the first size's figures.

On the H200 machine of two GPUs: `bash bench/h200.sh parallel` (a Qwen2.5-14B shape,
random bf16 weights). On the CPU the sizes are processes splitting its cores, which
checks the path end to end but times nothing worth a table.
"""

from __future__ import annotations

import argparse
import statistics

from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine
from tokendance.bench.engine import ours_decode, ours_prefill, rand_prompts, timed
from tokendance.bench.options import batches, counts, positive
from tokendance.bench.reuse import bench as reuse_rounds
from tokendance.bench.shapes import resolve


def measure(args: argparse.Namespace, size: int) -> dict:
    """One size's figures (the engine closed after)."""
    model, random = resolve(args.model)
    (pb, pn), (db, dn) = args.prefill[0], args.decode[0]
    rounds = max(args.agents) * (2 * args.history + max(args.agents) * args.output * 2) + 4096
    eng = Engine(EngineConfig(model=model, dtype=args.dtype, random_weights=random, tensor_parallel_size=size,
                              kv_tokens=max(pb * (pn + 16), db * (dn + args.steps + 16), rounds) + 1024,
                              max_batched_tokens=max(pb * pn, 16384), min_shared_tokens=0,
                              segment_cache_fraction=0.5))
    try:
        vocab = min(eng.mcfg.vocab_size, len(eng.tokenizer))
        ps = rand_prompts(pb, pn, vocab, seed=pn)
        ours_prefill(eng, ps)
        prefill = statistics.median(timed(lambda: ours_prefill(eng, ps), eng.device) for _ in range(args.repeats))
        ps = rand_prompts(db, dn, vocab, seed=dn + 1)
        ours_decode(eng, ps, args.steps)
        step = statistics.median(ours_decode(eng, ps, args.steps) for _ in range(args.repeats))
        rows = reuse_rounds(eng, args.agents, args.history, args.output, args.repeats, ["full", "collective"])
        out = dict(size=size, name=eng.name, dtype=str(eng.dtype), prefill=pb * pn / prefill, decode=db / step,
                   rounds={(r["agents"], r["mode"]): r["ms"] for r in rows})
    finally:
        eng.close()
    if eng.tp is not None and not eng.tp.agreed:
        raise RuntimeError(f"tensor-parallel size {size}: the ranks produced different tokens")
    return out


def table(res: list[dict], args: argparse.Namespace) -> str:
    (pb, pn), (db, dn) = args.prefill[0], args.decode[0]
    base = res[0]
    lines = [f"model {base['name']}, {base['dtype']}; each size in turn in one run, medians of {args.repeats}; "
             f"ratios against size {base['size']}",
             "| what | " + " | ".join(f"size {r['size']}" for r in res) + " |",
             "|---|" + "---|" * len(res)]

    def row(what: str, vals: list[float], unit: str, better_high: bool) -> str:
        cells = [f"{v:,.0f} {unit}" if i == 0 else
                 f"{v:,.0f} {unit} ({(v / vals[0] if better_high else vals[0] / v):.2f}x)"
                 for i, v in enumerate(vals)]
        return f"| {what} | " + " | ".join(cells) + " |"

    lines.append(row(f"prefill {pb}x{pn}", [r["prefill"] for r in res], "tok/s", True))
    lines.append(row(f"decode batch {db}, context {dn}", [r["decode"] for r in res], "tok/s", True))
    for key in base["rounds"]:
        n, mode = key
        lines.append(row(f"All-Gather round N = {n}, {mode} (first token)", [r["rounds"][key] for r in res],
                         "ms", False))
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-14b", help="HF folder, .gguf, or a shape name")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sizes", type=counts, default="1,2", help="tensor-parallel sizes, comma list")
    p.add_argument("--prefill", type=batches, default="10x2048", help="BATCHxLEN")
    p.add_argument("--decode", type=batches, default="32x4096", help="BATCHxCONTEXT")
    p.add_argument("--steps", type=positive, default=48)
    p.add_argument("--agents", type=counts, default="10,20", help="the rounds' N, comma list")
    p.add_argument("--history", type=positive, default=512)
    p.add_argument("--output", type=positive, default=150)
    p.add_argument("--repeats", type=positive, default=3)


def main(args: argparse.Namespace) -> int:
    if not args.prefill or not args.decode:
        raise ValueError("--prefill and --decode each need a BATCHxLEN")
    print(table([measure(args, size) for size in args.sizes], args))
    return 0
