"""`tokendance bench kv-dtype`: 8-bit precision against the model's dtype, on the same prompts,
in one run: an 8-bit KV pool (`--kv`, vLLM's `--kv-cache-dtype fp8`), 8-bit weights
(`--quantization fp8`, vLLM's, or `--weights DIR`, a checkpoint in 8 bits of the same
model: `tokendance quantize`'s, per row or `--block`), or both.

1. Teacher-forced: each round-2 debate prompt (every agent sees every other's round-1
   answer; through the proxy's segmentation, as served) gets its greedy continuation of T
   tokens from the model-dtype engine; that continuation is fed through each engine in one
   forward after the prompt's prefill, every position reading the prompt's K/V from the
   pool. Per position: whether the 8-bit engine's argmax picks the same token as the
   model-dtype engine's, and KL(model dtype || 8-bit) of the next-token distributions.
2. Free-running greedy: prompts whose T tokens are the model dtype's, and where the others
   first differ.
3. Each engine's bytes (KV a token, weights), a prefill of N prompts of L tokens (tokens a
   second, medians of repeats) and a decode step of B sequences at a context of C (medians
   of repeats).
Sections 1 and 2 need real weights; a shape name (random weights) runs section 3 alone.
The engines are built one after the other, so a GPU holds one model at a time.
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

from tokendance.backend import loader
from tokendance.backend.api import QUANTIZATIONS, SamplingParams
from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine
from tokendance.backend.scheduler import Scheduled
from tokendance.backend.service import EngineBackend
from tokendance.bench.debates import Board, debate, questions
from tokendance.bench.engine import ours_decode, ours_prefill, rand_prompts, timed
from tokendance.bench.fidelity import continued, run
from tokendance.bench.options import batches, natural, positive
from tokendance.bench.shapes import resolve

GREEDY = SamplingParams(max_tokens=48, temperature=0)


def engine(args: argparse.Namespace, kv: str, quantization: str | None, folder: str | None = None) -> Engine:
    """An engine of `args.model` (or of `folder`, a checkpoint of the same model)."""
    folder, random = (folder, False) if folder else resolve(args.model)
    return Engine(EngineConfig(model=folder, dtype=args.dtype, kv_cache_dtype=kv, random_weights=random,
                               quantization=quantization, kv_tokens=args.kv_tokens, max_batched_tokens=16384))


def weight_bytes(eng: Engine) -> int:
    """The model's tensors: parameters, buffers (8-bit weights and their scales) and the
    plain tensors modules hold (the CPU's packed weights), each once."""
    held = {id(t): t for m in eng.model.modules()
            for t in (*m._parameters.values(), *m._buffers.values(), *vars(m).values())
            if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in held.values())


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
    out: dict = {"bytes": eng.kv_bytes_per_token, "weights": weight_bytes(eng)}
    if ids:
        sampling = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        out["free"] = [t for t, _, _ in eng.generate(ids, sampling)]
        out["forced"] = forced(eng, ids, cont or out["free"])
    out["prefill"] = []
    for n, length in args.prefill:
        batch = rand_prompts(n, length, min(eng.mcfg.vocab_size, len(eng.tokenizer)), 1)
        ours_prefill(eng, batch)  # warm-up
        secs = statistics.median(timed(lambda: ours_prefill(eng, batch), eng.device) for _ in range(args.repeats))
        out["prefill"].append(n * length / secs)
    eng.reset_caches()
    out["decode"] = []
    for b, c in args.decode:
        batch = rand_prompts(b, c, min(eng.mcfg.vocab_size, len(eng.tokenizer)), 0)
        out["decode"].append(statistics.median(ours_decode(eng, batch, args.steps) for _ in range(args.repeats)))
        eng.reset_caches()
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf, or a shape name (random weights: section 3 alone)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), default="fp8",
                   help="the 8-bit pool's format (auto: the model's dtype, weights alone compared)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help="8-bit weights too (fp8)")
    p.add_argument("--weights", default=None, metavar="DIR",
                   help="8-bit weights as a checkpoint of the model stores them (`tokendance quantize` "
                        "[--block]), compared with --model's")
    p.add_argument("--agents", type=positive, default=4, help="agents of each debate")
    p.add_argument("--questions", type=natural, default=2, help="debates (0: no sections 1 and 2)")
    p.add_argument("--tokens", type=positive, default=32, help="continuation tokens per prompt")
    p.add_argument("--prefill", type=batches, default="", help="PROMPTSxLENGTH,... (empty: none)")
    p.add_argument("--decode", type=batches, default="8x1024", help="BATCHxCONTEXT,... (empty: none)")
    p.add_argument("--steps", type=positive, default=16)
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--kv-tokens", type=natural, default=65536, help="each pool's size in tokens")


def main(args: argparse.Namespace) -> int:
    if args.kv == "auto" and args.quantization is None and args.weights is None:
        raise ValueError("nothing to compare: give --kv fp8 (or another 8-bit format), --quantization fp8 "
                         "or --weights DIR")
    if args.weights and args.quantization:
        raise ValueError("--weights DIR holds its own 8-bit weights: give it or --quantization, not both")
    if args.weights and not (loader.resolve(args.weights) / "config.json").is_file():  # before the wide model loads
        raise ValueError(f"--weights {args.weights}: no config.json in it (a checkpoint folder of the model, as "
                         "`tokendance quantize` writes)")
    random = resolve(args.model)[1]
    base = engine(args, "auto", None)
    ids = [] if random or not args.questions else prompts(base, args.agents, args.questions)
    name, device, dtype = base.name, base.device, str(base.dtype).removeprefix("torch.")
    ref = measure(base, args, ids, None)
    del base
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ours = measure(engine(args, args.kv, args.quantization, args.weights), args, ids, ref.get("free"))
    parts = [f"{args.kv} pool"] * (args.kv != "auto") + [f"{args.quantization} weights"] * bool(args.quantization)
    parts += [f"the weights of {args.weights}"] * bool(args.weights)
    label = " + ".join(parts)
    print(f"model {name} on {device}, {dtype}; {dtype} against {label}")
    m = 2**20
    print(f"| engine | KV bytes per token | weights MiB |\n|---|---|---|\n| {dtype} | {ref['bytes']:,} | "
          f"{ref['weights'] / m:,.1f} |\n| {label} | {ours['bytes']:,} | {ours['weights'] / m:,.1f} |")
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
    if args.prefill:
        print(f"\nPrefill, tokens a second, medians of {args.repeats}:")
        print(f"| prompts x length | {dtype} | {label} | ratio |\n|---|---|---|---|")
        for (n, length), x, y in zip(args.prefill, ref["prefill"], ours["prefill"]):
            print(f"| {n} x {length} | {x:,.0f} | {y:,.0f} | {y / x:.2f}x |")
    if args.decode:
        print(f"\nDecode step, medians of {args.repeats} x {args.steps} steps:")
        print(f"| batch x context | {dtype} (ms) | {label} (ms) | ratio |\n|---|---|---|---|")
        for (b, c), x, y in zip(args.decode, ref["decode"], ours["decode"]):
            print(f"| {b} x {c} | {x * 1e3:.2f} | {y * 1e3:.2f} | {x / y:.2f}x |")
    return 0
