"""Sliding-window attention on CUDA, at Mistral 7B v0.1's attention shape (Hq=32, Hkv=8,
D=128, a window of 4,096, bf16): the kernels against the reference, then timed.

(a) Correctness: prefill, chunked prefill and decode against the reference in a window.
(b) Decode of 32 sequences at 8,192 keys, window 4,096, against the same without a
    window (every key read) and without a window at 4,096 keys (the window's bytes):
    a window's step should cost what its keys cost.
(c) A prefill chunk of 2,048 rows after 6,144 keys, the same three ways.
(d) A fresh prompt of 8,192 tokens (flash attention's window_size_left, kernels/prefill.py)
    against the same without a window.
(e) Gemma 3 1B's attention (Hq=4, Hkv=1, head dim 256, window 512): a prefill chunk of
    2,048 rows after 2,048 keys per launch configuration (the default one, tuned at 128,
    spills registers at 256: bench/ptx.py).

    PYTHONPATH=<dir holding tokendance/> python bench/windows.py [--smoke]

--smoke runs small shapes under TRITON_INTERPRET=1 on the CPU (checks the script only).
"""

from __future__ import annotations

import os
import sys
from functools import partial

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from tokendance.bench.kernel_timing import median_ms, rel, say, summary  # noqa: E402
from tokendance.kernels import paged_attention as pa  # noqa: E402
from tokendance.kernels.prefill import causal_attention  # noqa: E402
from tokendance.kernels.tiles import trig_table  # noqa: E402

from tokendance.bench.kernels import make, suffix  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
bench = partial(median_ms, smoke=SMOKE)
HQ, HKV, D = (4, 1, 128) if SMOKE else (32, 8, 128)
WIN = 40 if SMOKE else 4096


def correctness() -> bool:
    """Each kernel against the reference in a window (float32 and bf16 inputs)."""
    ok = True
    n = 90 if SMOKE else 1500
    w = 23 if SMOKE else 600
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 2e-2)):
        for kind, nq in (("prefill", [n, n // 3]), ("chunked", [n // 4, 5]), ("decode", [1, 1])):
            args = make([n, n // 3 + 7], suffix([n, n // 3 + 7], nq), HQ, HKV, D, dtype)
            ref = pa.paged_attention_reference(*args, window=w)
            got = pa.paged_attention_triton(*args, trig=trig_table(args[7], n + 8), window=w)
            err = rel(got.float(), ref.float())
            ok &= err < tol
            say(f"  {kind:8s} {str(dtype)[6:]:8s} window {w}: rel {err:.1e} {'ok' if err < tol else 'FAIL'}")
    return ok


def timed(kind: str, lens: list[int], nq: list[int], ideal: int | None) -> list[str]:
    """The kernel at `lens` keys in the window, without one, and (decode) without one at
    `ideal` keys: the window's bytes. Each row's (query, key) pairs are counted."""
    rows = []
    full = make(lens, suffix(lens, nq), HQ, HKV, D, torch.bfloat16)
    trig = trig_table(full[7], max(lens) + 64)
    mq = max(nq)
    cases = [(f"window {WIN} over {lens[0]} keys", full, WIN), (f"no window, {lens[0]} keys", full, 0)]
    if ideal:
        cases.append((f"no window, {ideal} keys", make([ideal] * len(lens), suffix([ideal] * len(lens), nq),
                                                      HQ, HKV, D, torch.bfloat16), 0))
    base = None
    for name, args, w in cases:
        ms = bench(lambda a=args, w=w: pa.paged_attention_triton(*a, max_q=mq, trig=trig, window=w))
        base = base or ms
        pairs = sum(min(p + 1, w or p + 1) for p in args[1].tolist())
        line = f"{kind:8s} {name:30s} {ms * 1e3:9.1f} us  {ms / base:5.2f}x the window's, pairs {pairs:,}"
        say("  " + line)
        rows.append(line)
    return rows


def fresh(n: int) -> list[str]:
    """causal_attention over one fresh prompt of n tokens, in the window and without."""
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(n, h, D, generator=g, device=DEV).to(torch.bfloat16) for h in (HQ, HKV, HKV))
    cu = [0, n]
    cu_dev = torch.tensor(cu, dtype=torch.int32, device=DEV)
    rows, base = [], None
    for name, w in ((f"window {WIN}", WIN), ("no window", 0)):
        ms = bench(lambda w=w: causal_attention(q, k, v, cu, D ** -0.5, cu_dev, w))
        base = base or ms
        line = f"fresh    {n} tokens, {name:19s} {ms * 1e3:9.1f} us  {ms / base:5.2f}x the window's"
        say("  " + line)
        rows.append(line)
    return rows


GEMMA_CFGS = [dict(), dict(block_n=32), dict(block_m=64), dict(block_m=64, block_n=32),
              dict(block_m=64, num_warps=4), dict(block_m=32, num_warps=4)]


def gemma_prefill() -> list[str]:
    """(e): the prefill kernel at head dim 256 per launch configuration, in a window of 512."""
    from tokendance.kernels.paged_triton import PREFILL_CFG

    n, rows, w = (64, 32, 24) if SMOKE else (4096, 2048, 512)
    args = make([n], suffix([n], [rows]), 4, 1, 256, torch.bfloat16)
    ref = pa.paged_attention_reference(*args, window=w)
    out, base = [], None
    for c in GEMMA_CFGS[:2] if SMOKE else GEMMA_CFGS:
        cfg = {**PREFILL_CFG, **c}
        fn = lambda cfg=cfg: pa.paged_attention_triton(*args, max_q=rows, cfg=cfg, window=w)  # noqa: E731
        ms = bench(fn)
        base = base or ms
        name = " ".join(f"{k.removeprefix('block_').removeprefix('num_')}={v}" for k, v in cfg.items())
        line = f"gemma    {name:44s} {ms * 1e3:9.1f} us  {ms / base:5.2f}x the default's, rel {rel(fn().float(), ref.float()):.1e}"
        say("  " + line)
        out.append(line)
    return out


def main() -> None:
    torch.manual_seed(0)
    if not SMOKE:
        p = torch.cuda.get_device_properties(0)
        say(f"{p.name}; torch {torch.__version__}; Hq={HQ} Hkv={HKV} D={D}, window {WIN}")
    say("(a) correctness")
    ok = correctness()
    s, n = (2, 96) if SMOKE else (32, 2 * WIN)
    say(f"(b) decode: {s} x {n} keys")
    rows = timed("decode", [n] * s, [1] * s, WIN)
    say(f"(c) prefill: a chunk of {n // 4} rows after {n - n // 4} keys")
    rows += timed("prefill", [n], [n // 4], None)
    say(f"(d) a fresh prompt of {n} tokens")
    rows += fresh(n)
    say("(e) Gemma 3 1B's attention: prefill launch configurations at head dim 256")
    rows += gemma_prefill()
    sys.exit(summary("bench_windows.log", ok, rows))


if __name__ == "__main__":
    main()
