"""`tokendance bench engine`: our engine against HF transformers, same weights, same run.

Prefill tokens/s (one sequence of L tokens, or a batch of equal sequences) and decode
tokens/s at several batch sizes with a given context; medians of repeats.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch

from tokendance.backend.api import SamplingParams
from tokendance.backend.device import sync
from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine
from tokendance.bench.options import batches, natural, positive
from tokendance.bench.shapes import SHAPES, resolve
from tokendance.bench.small import small_folder


def timed(fn, dev: torch.device) -> float:
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    return time.perf_counter() - t0


def paired(ours, hf, repeats: int) -> tuple[float, float]:
    """Medians of `repeats` runs of each side, taken in alternating pairs after one
    warm-up each: a noisy machine's slow spell then hits both sides alike, not one."""
    ours(), hf()
    runs = [(ours(), hf()) for _ in range(repeats)]
    return statistics.median(a for a, _ in runs), statistics.median(b for _, b in runs)


def rand_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


# -- ours ----------------------------------------------------------------------------

def ours_prefill(eng: Engine, prompts: list[list[int]]) -> None:
    eng.reset_caches()
    eng.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))


def ours_decode(eng: Engine, prompts: list[list[int]], steps: int, temperature: float = 0.0) -> float:
    """Seconds per decode step for the batch, after its prefill."""
    for i, p in enumerate(prompts):
        eng.add(f"d{i}", p, SamplingParams(max_tokens=steps + 1, temperature=temperature, ignore_eos=True))
    while any(s.computed < len(s.prompt) for s in eng.seqs.values()):
        eng.step()
    sync(eng.device)
    t0 = time.perf_counter()
    while eng.has_work():
        eng.step()
    sync(eng.device)
    return (time.perf_counter() - t0) / steps  # each sequence's last `steps` tokens


# -- HF --------------------------------------------------------------------------------

def hf_model(folder: Path, dtype: torch.dtype, dev: torch.device, random: bool):
    """HF's model, attention through SDPA, or eager where SDPA cannot compute it (Gemma 2's
    capped scores)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    attn = "eager" if getattr(cfg, "attn_logit_softcapping", None) else "sdpa"
    if random:
        cfg._attn_implementation = attn
        with torch.device(dev):
            return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn).to(dev).eval()


@torch.inference_mode()
def hf_prefill(hf, prompts: list[list[int]], dev: torch.device) -> None:
    hf(torch.tensor(prompts, device=dev), logits_to_keep=1)


def pick(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """HF generate's next tokens [B, 1]: the argmax, or one batched multinomial draw."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    return torch.multinomial((logits.float() / temperature).softmax(-1), 1)


@torch.inference_mode()
def hf_decode(hf, prompts: list[list[int]], steps: int, dev: torch.device, temperature: float = 0.0) -> float:
    # The KV cache's argument and output field: `cache` in newer transformers (which
    # deprecate `past_key_values`), `past_key_values` before.
    kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out = hf(torch.tensor(prompts, device=dev), use_cache=True, logits_to_keep=1)
    pkv, nxt = getattr(out, kw), pick(out.logits[:, -1], temperature)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = hf(nxt, use_cache=True, **{kw: pkv})
        pkv, nxt = getattr(out, kw), pick(out.logits[:, -1], temperature)
    sync(dev)
    return (time.perf_counter() - t0) / steps


# -- the run -------------------------------------------------------------------------

def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder, .gguf, or a shape name (qwen2.5-7b)")
    p.add_argument("--layers", type=positive, default=None,
                   help="a shape's first N layers (its widths, quicker to build and to run)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prefill", type=batches, default="1x1024,1x4096", help="BATCHxLEN,...")
    p.add_argument("--decode", type=batches, default="1x256,8x256", help="BATCHxCONTEXT,...")
    p.add_argument("--steps", type=positive, default=32)
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="decode: 0 greedy; above, sampled (HF with one multinomial draw a step)")
    p.add_argument("--kv-tokens", type=natural, default=0,
                   help="the pool, if larger than the run needs (on a CPU the held rotated keys of a "
                        "decode batch get the pool's bytes: the default pool is 16 k tokens)")
    p.add_argument("--breakdown", action="store_true",
                   help="then split each decode step into GPU forward and host time")


def main(args: argparse.Namespace) -> int:
    model, random = resolve(args.model)
    if args.layers:
        if args.model not in SHAPES:
            print(f"--layers: {args.model!r} is not a shape name ({', '.join(SHAPES)})", file=sys.stderr)
            return 2
        model = str(small_folder(args.layers, args.model))
    pre, dec = args.prefill, args.decode
    need = max([b * (n + args.steps + 16) for b, n in pre + dec]) + 1024
    eng = Engine(EngineConfig(model=model, dtype=args.dtype, random_weights=random, kv_tokens=max(need, args.kv_tokens),
                              max_batched_tokens=max(b * n for b, n in pre + dec)))
    dev, vocab = eng.device, min(eng.mcfg.vocab_size, len(eng.tokenizer))
    hf = hf_model(eng.folder, eng.dtype, dev, random)
    rows = []
    for b, n in pre:
        ps = rand_prompts(b, n, vocab, seed=n)
        t_ours, t_hf = paired(lambda: timed(lambda: ours_prefill(eng, ps), dev),
                              lambda: timed(lambda: hf_prefill(hf, ps, dev), dev), args.repeats)
        rows.append((f"prefill {b}x{n}", b * n / t_ours, b * n / t_hf, "tok/s"))
    for b, n in dec:
        ps = rand_prompts(b, n, vocab, seed=n + 1)
        t_ours, t_hf = paired(lambda: ours_decode(eng, ps, args.steps, args.temperature),
                              lambda: hf_decode(hf, ps, args.steps, dev, args.temperature), args.repeats)
        how = f", temperature {args.temperature:g}" if args.temperature else ""
        rows.append((f"decode batch {b}, context {n}{how}", b / t_ours, b / t_hf, "tok/s"))
    attn = "SDPA" if hf.config._attn_implementation == "sdpa" else hf.config._attn_implementation
    print(f"model {eng.name} on {dev}, {eng.dtype}; HF transformers ({attn} attention) in the same run, "
          f"medians of {args.repeats} alternating pairs")
    print("| what | ours | HF | ratio |\n|---|---|---|---|")
    for name, a, h, unit in rows:
        print(f"| {name} | {a:,.0f} {unit} | {h:,.0f} {unit} | {a / h:.2f}x |")
    if args.breakdown:
        from tokendance.bench.step_split import breakdown

        for b, n in dec:
            print("\n" + breakdown(eng, rand_prompts(b, n, vocab, seed=n + 2), args.steps))
    return 0
