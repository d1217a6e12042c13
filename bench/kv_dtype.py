"""`tokendance bench kv-dtype`: an 8-bit KV pool (`--kv-cache-dtype fp8`) against one in the
model's dtype, on the same prompts, in one run.

1. Teacher-forced: each round-2 debate prompt (every agent sees every other's round-1
   answer; through the proxy's segmentation, as served) gets its greedy continuation of T
   tokens from the model-dtype pool; that continuation is fed through each engine in one
   forward after the prompt's prefill, every position reading the prompt's K/V from the
   pool. Per position: whether the 8-bit engine's argmax picks the same token as the
   model-dtype engine's, and KL(model dtype || 8-bit) of the next-token distributions.
2. Free-running greedy: prompts whose T tokens are the model dtype's, and where the others
   first differ.
3. A decode step of B sequences at a context of C in each pool (medians of repeats), and
   each pool's bytes per token.
Sections 1 and 2 need real weights; a shape name (random weights) runs section 3 alone.
The engines are built one after the other, so a GPU holds one model at a time.
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine
from tokendance.backend.scheduler import Scheduled
from tokendance.backend.service import EngineBackend
from tokendance.bench.debates import Board, debate, questions
from tokendance.bench.engine import ours_decode, rand_prompts
from tokendance.bench.fidelity import continued, run
from tokendance.bench.options import batches, natural, positive
from tokendance.bench.shapes import resolve

GREEDY = SamplingParams(max_tokens=48, temperature=0)


def engine(args: argparse.Namespace, kv: str) -> Engine:
    folder, random = resolve(args.model)
    return Engine(EngineConfig(model=folder, dtype=args.dtype, kv_cache_dtype=kv, random_weights=random,
                               kv_tokens=args.kv_tokens, max_batched_tokens=16384))


def prompts(eng: Engine, agents: int, count: int) -> list[list[int]]:
    """Round-2 prompts of `count` debates of `agents` agents, round 1 answered by `eng`."""
    be, out = EngineBackend(eng), []
    for k in range(min(count, len(questions("bench")))):
        b = Board(debate("bench", agents, k))
        b.observe(run(eng, b.requests(be, "full", GREEDY), "full"))
        out += [p.state.ids for p in b.requests(be, "full", GREEDY)]
    return out


@torch.inference_mode()
def forced(eng: Engine, ids: list[list[int]], cont: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, the log-probabilities [T, vocab] after each prefix of its continuation:
    the prompt prefilled, then the continuation in one forward that reads the prompt's
    K/V from the pool."""
    out = []
    for i, (p, c) in enumerate(zip(ids, cont)):
        eng.add(f"forced-{i}", p, SamplingParams(max_tokens=1, temperature=0))
        s = eng.seqs[f"forced-{i}"]
        assert eng.blocks.reserve(s, len(s.prompt))
        first, _ = eng.runner.run([Scheduled(s, 0, len(s.prompt))])
        out.append(torch.cat([first, continued(eng, s, c)]).float().log_softmax(-1).cpu())
        eng.abort(s.id)
    return out


def measure(eng: Engine, args: argparse.Namespace, ids: list[list[int]], cont: list[list[int]] | None) -> dict:
    """What section 1, 2 and 3 need of one engine."""
    out: dict = {"bytes": eng.kv_bytes_per_token}
    if ids:
        sampling = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        out["free"] = [t for t, _, _ in eng.generate(ids, sampling)]
        out["forced"] = forced(eng, ids, cont or out["free"])
    out["decode"] = []
    for b, c in args.decode:
        batch = rand_prompts(b, c, min(eng.mcfg.vocab_size, len(eng.tokenizer)), 0)
        out["decode"].append(statistics.median(ours_decode(eng, batch, args.steps) for _ in range(args.repeats)))
        eng.reset_caches()
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf, or a shape name (random weights: section 3 alone)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv", choices=("fp8", "fp8_e4m3", "fp8_e5m2"), default="fp8", help="the 8-bit pool's format")
    p.add_argument("--agents", type=positive, default=4, help="agents of each debate")
    p.add_argument("--questions", type=natural, default=2, help="debates (0: no sections 1 and 2)")
    p.add_argument("--tokens", type=positive, default=32, help="continuation tokens per prompt")
    p.add_argument("--decode", type=batches, default="8x1024", help="BATCHxCONTEXT,... (empty: none)")
    p.add_argument("--steps", type=positive, default=16)
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--kv-tokens", type=natural, default=65536, help="each pool's size in tokens")


def main(args: argparse.Namespace) -> int:
    random = resolve(args.model)[1]
    base = engine(args, "auto")
    ids = [] if random or not args.questions else prompts(base, args.agents, args.questions)
    name, device, dtype = base.name, base.device, str(base.dtype).removeprefix("torch.")
    ref = measure(base, args, ids, None)
    del base
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ours = measure(engine(args, args.kv), args, ids, ref.get("free"))
    print(f"model {name} on {device}, {dtype}; KV pool {dtype} against {args.kv}")
    print(f"| pool | bytes per token |\n|---|---|\n| {dtype} | {ref['bytes']:,} |\n| {args.kv} | {ours['bytes']:,} |")
    if ids:
        hits = [bool(x) for a, b in zip(ref["forced"], ours["forced"]) for x in a.argmax(-1) == b.argmax(-1)]
        kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(ref["forced"], ours["forced"])])
        same = sum(a == b for a, b in zip(ref["free"], ours["free"]))
        firsts = [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
                  for a, b in zip(ref["free"], ours["free"]) if a != b]
        print(f"\n{len(ids)} round-2 debate prompts ({args.agents} agents, {len(ids) // args.agents} debate(s)), "
              f"{args.tokens} tokens each:")
        print("| teacher-forced agreement | KL mean | KL max | greedy identical | mean first difference |")
        print("|---|---|---|---|---|")
        mean = f"token {statistics.mean(firsts):.1f}" if firsts else "-"
        print(f"| {statistics.mean(hits):.3f} | {kl.mean():.2e} | {kl.max():.2e} | {same}/{len(ids)} | {mean} |")
    if args.decode:
        print(f"\nDecode step, medians of {args.repeats} x {args.steps} steps:")
        print(f"| batch x context | {dtype} (ms) | {args.kv} (ms) | ratio |\n|---|---|---|---|")
        for (b, c), x, y in zip(args.decode, ref["decode"], ours["decode"]):
            print(f"| {b} x {c} | {x * 1e3:.2f} | {y * 1e3:.2f} | {x / y:.2f}x |")
    return 0
