"""What embeddings cost: the engine's pooling requests (backend/pooling.py, what
/v1/embeddings runs) against HF transformers' forward over the same prompts.

    python -m tokendance.bench.embed [--model PATH] [--dtype auto] [--inputs 64]
                                     [--tokens 16,256] [--batch 32] [--repeats 7]

`inputs` random prompts, their lengths spread evenly over the `tokens` range. Ours: each
added as a pooling request, the engine stepped until all are done (it batches them to its
step budget), its prefix cache cleared first. HF: the base model (no LM head) over
batches of `batch` prompts sorted by length and padded on the left, as
sentence-transformers batches, each prompt's last hidden state normalized. Both sides in
alternating pairs after a warm-up each; medians in ms and tokens/s. On a real model (the
same weights on both sides) it also gives the largest difference between the vectors.
"""

from __future__ import annotations

import argparse

import torch

from tokendance.backend import heap
from tokendance.backend.api import Pooling, SamplingParams
from tokendance.backend.device import sync
from tokendance.backend.engine import Engine
from tokendance.bench.engine import hf_model, paired, timed
from tokendance.bench.options import positive
from tokendance.bench.shapes import resolve


def lengths(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"{text!r}: want MIN,MAX token counts with 1 <= MIN <= MAX")
    return a, b


def ours(eng: Engine, prompts: list[list[int]]) -> list[list[float]]:
    eng.reset_caches()
    for i, p in enumerate(prompts):
        eng.add(f"e{i}", p, SamplingParams(max_tokens=1), "full", pool=Pooling())
    got: dict[str, list[float]] = {}
    while eng.has_work():
        for rid, d in eng.step():
            if d.embedding is not None:
                got[rid] = d.embedding
    return [got[f"e{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def hf_embed(base, prompts: list[list[int]], batch: int, dev: torch.device) -> list[torch.Tensor]:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    for at in range(0, len(order), batch):
        part = order[at:at + batch]
        n = max(len(prompts[i]) for i in part)
        ids = torch.tensor([[0] * (n - len(prompts[i])) + prompts[i] for i in part], device=dev)
        mask = torch.tensor([[0] * (n - len(prompts[i])) + [1] * len(prompts[i]) for i in part], device=dev)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        h = base(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state[:, -1]
        for i, v in zip(part, torch.nn.functional.normalize(h.float(), dim=-1)):
            out[i] = v
    sync(dev)
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="HF folder, .gguf, or a shape name with random weights (qwen2.5-7b); default: SmolLM2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--inputs", type=positive, default=64)
    ap.add_argument("--tokens", type=lengths, default=(16, 256), help="MIN,MAX prompt tokens")
    ap.add_argument("--batch", type=positive, default=32, help="HF's batch")
    ap.add_argument("--repeats", type=positive, default=7)
    args = ap.parse_args(argv)
    from tokendance.backend.config import EngineConfig

    model, random = resolve(args.model)
    lo, hi = args.tokens
    eng = Engine(EngineConfig(model=model, dtype=args.dtype, random_weights=random,
                              kv_tokens=max(4096, 2 * args.inputs * (hi + 16))))
    dev = eng.device
    hf = hf_model(eng.folder, eng.dtype, dev, random)
    vocab = min(eng.mcfg.vocab_size, len(eng.tokenizer))
    g = torch.Generator().manual_seed(0)
    sizes = [lo + (hi - lo) * i // max(1, args.inputs - 1) for i in range(args.inputs)]
    prompts = [torch.randint(100, vocab, (n,), generator=g).tolist() for n in sizes]
    with heap.frozen():  # as `serve` serves
        t_ours, t_hf = paired(lambda: timed(lambda: ours(eng, prompts), dev),
                              lambda: timed(lambda: hf_embed(hf.model, prompts, args.batch, dev), dev), args.repeats)
    tokens = sum(sizes)
    print(f"{args.inputs} prompts of {lo}-{hi} tokens ({tokens} in all), {dev} {eng.dtype}, HF in batches of "
          f"{args.batch} sorted by length, medians of {args.repeats}:")
    print(f"  ours {t_ours * 1e3:9.1f} ms  {tokens / t_ours:9.0f} tok/s")
    print(f"  HF   {t_hf * 1e3:9.1f} ms  {tokens / t_hf:9.0f} tok/s")
    print(f"  ours / HF time: {t_ours / t_hf:.2f}x ({t_hf / t_ours:.2f}x the throughput)")
    result = {"ours_ms": t_ours * 1e3, "hf_ms": t_hf * 1e3, "speedup": t_hf / t_ours}
    if not random:
        a = torch.tensor(ours(eng, prompts))
        b = torch.stack(hf_embed(hf.model, prompts, args.batch, dev)).cpu()
        result["max_diff"] = (a - b).abs().max().item()
        print(f"  largest difference between the vectors: {result['max_diff']:.2e}")
    return result


if __name__ == "__main__":
    main()
