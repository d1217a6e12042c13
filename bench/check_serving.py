"""CUDA checks of what serving asks of the engine: a structured output held only after its
marker (a reasoning model's thinking first), and the memory share of
--gpu-memory-utilization (backend/budget.py). bench/check_cuda.py runs them."""

from __future__ import annotations

import json

import torch

from tokendance.backend.api import SamplingParams, Structure
from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine
from tokendance.bench.allgather import make_round
from tokendance.bench.engine import rand_prompts
from tokendance.bench.shapes import shape_folder
from tokendance.bench.small import seeded


def structured_after() -> bool | None:
    """A grammar held after its marker (Structure.after, a reasoning model's "</think>"),
    with lookahead on: free up to the marker, held from it; never held without it. None
    without xgrammar (the device's carried wheels, bench/h200.sh)."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return None
    eng = seeded()
    prompt, marker = list(range(100, 140)), " Meanwhile"
    (tok,) = eng.tokenizer.encode(marker, add_special_tokens=False)
    yes_no = json.dumps(["yes", "no"])

    def text(st: Structure | None, **kw) -> tuple[list[int], str]:
        ids, out, _ = eng.generate([prompt], SamplingParams(temperature=0, structure=st, **kw))[0]
        return ids, out

    forced = text(Structure("choice", yes_no, after=marker), max_tokens=40, logit_bias={tok: 100.0})[1]
    first = text(Structure("choice", yes_no), max_tokens=40)[1]
    never = text(Structure("choice", yes_no, after="</think>"), max_tokens=12)[0] == text(None, max_tokens=12)[0]
    return forced in (marker + "yes", marker + "no") and first in ("yes", "no") and never


def memory_share(util: float = 0.3) -> bool:
    """--gpu-memory-utilization on a Qwen2.5-7B shape (random bf16 weights): what torch
    holds at its peak (weights, the pool, every step's activations) stays within the
    share, through full prefill steps and decode (run in a process of its own)."""
    free0, total = torch.cuda.mem_get_info()
    eng = Engine(EngineConfig(model=str(shape_folder("qwen2.5-7b")), dtype="bfloat16", random_weights=True,
                              gpu_memory_utilization=util))
    pool = eng.cache.kv.numel() * eng.cache.kv.element_size()
    ready = torch.cuda.max_memory_reserved()
    vocab = eng.mcfg.vocab_size
    eng.generate(rand_prompts(8, 2048, vocab, 1), SamplingParams(max_tokens=1, ignore_eos=True))  # full steps
    prefill = torch.cuda.max_memory_reserved()
    eng.generate(rand_prompts(64, 1024, vocab, 2), SamplingParams(max_tokens=32, ignore_eos=True))
    decode = torch.cuda.max_memory_reserved()
    rnd = make_round(20, 512, 150, vocab, seed=3)  # a cold collective All-Gather round, bench reuse's
    eng.generate(rnd.prompts, SamplingParams(max_tokens=8, ignore_eos=True), mode="collective", shared=rnd.shared)
    peak = torch.cuda.max_memory_reserved()
    other = free0 - torch.cuda.mem_get_info()[0] - torch.cuda.memory_reserved()  # not torch's: libraries'
    g = 2**30
    print(f"--gpu-memory-utilization {util}: pool {pool / g:.1f} GiB; torch held at most {ready / g:.1f} GiB "
          f"once ready, {prefill / g:.1f} through a full prefill step, {decode / g:.1f} through decode, "
          f"{peak / g:.1f} through a collective round, besides {other / g:.2f} GiB outside torch; the share "
          f"is {util * total / g:.1f} GiB")
    return peak + other <= util * total
