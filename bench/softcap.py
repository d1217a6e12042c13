"""Capped attention scores (Gemma 2: s -> cap * tanh(s / cap)) on CUDA, at Gemma 2 2B's
attention shape (Hq=8, Hkv=4, D=256, cap 50, bf16): the kernels against the reference, then
timed against the same kernels uncapped.

(a) Correctness: prefill, chunked prefill and decode (with and without a window) and a
    fresh prompt's path (the paged kernel over one-slot blocks) against the reference.
(b) Decode of 32 sequences at 4,096 keys, capped against uncapped: the tanh's cost.
(c) A prefill chunk of 1,024 rows after 3,072 keys, the same two ways.
(d) A fresh prompt of 4,096 tokens: the capped kernel (kernels/prefill.py `capped_triton`)
    against flash attention uncapped and against torch's capped scores written out (the
    CPU's path, kernels/softcap.py).

    PYTHONPATH=<dir holding tokendance/> python bench/softcap.py [--smoke]

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
from tokendance.kernels import softcap  # noqa: E402
from tokendance.kernels.prefill import capped_triton, causal_attention  # noqa: E402
from tokendance.kernels.tiles import trig_table  # noqa: E402

from tokendance.bench.kernels import make, suffix  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
bench = partial(median_ms, smoke=SMOKE)
HQ, HKV, D = (2, 1, 64) if SMOKE else (8, 4, 256)
CAP = 50.0


def correctness() -> bool:
    """Each kernel against the reference, capped (queries scaled so the cap bends scores)."""
    ok = True
    n = 90 if SMOKE else 1500
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 2e-2)):
        for kind, nq, w in (("prefill", [n, n // 3], 0), ("chunked", [n // 4, 5], 0), ("decode", [1, 1], 0),
                            ("decode", [1, 1], n // 3), ("chunked", [n // 4, 5], n // 3)):
            args = make([n, n // 3 + 7], suffix([n, n // 3 + 7], nq), HQ, HKV, D, dtype)
            args = (args[0] * 40,) + args[1:]  # scores of tens: a cap of 50 bends them
            ref = pa.paged_attention_reference(*args, window=w, softcap=CAP)
            got = pa.paged_attention_triton(*args, trig=trig_table(args[7], n + 8), window=w, softcap=CAP)
            ok &= check(f"{kind} window {w}", dtype, rel(got.float(), ref.float()), tol)
        q, k, v = (torch.randn(n, h, D, device=DEV).to(dtype) for h in (HQ, HKV, HKV))
        q = q * 40
        cu = [0, n // 3, n]
        ref = causal_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), cu, D ** -0.5, softcap=CAP)
        got = capped_triton(q, k, v, cu, D ** -0.5, 0, CAP)
        ok &= check("fresh", dtype, rel(got.cpu().float(), ref), tol)
    return ok


def check(name: str, dtype: torch.dtype, err: float, tol: float) -> bool:
    say(f"  {name:18s} {str(dtype)[6:]:8s} cap {CAP:g}: rel {err:.1e} {'ok' if err < tol else 'FAIL'}")
    return err < tol


def timed(kind: str, lens: list[int], nq: list[int]) -> list[str]:
    """The kernel capped and uncapped at the same keys."""
    args = make(lens, suffix(lens, nq), HQ, HKV, D, torch.bfloat16)
    trig = trig_table(args[7], max(lens) + 64)
    rows, base = [], None
    for name, cap in (("uncapped", 0.0), (f"capped at {CAP:g}", CAP)):
        ms = bench(lambda cap=cap: pa.paged_attention_triton(*args, max_q=max(nq), trig=trig, softcap=cap))
        base = base or ms
        line = f"{kind:8s} {name:30s} {ms * 1e3:9.1f} us  {ms / base:5.2f}x uncapped"
        say("  " + line)
        rows.append(line)
    return rows


def fresh(n: int) -> list[str]:
    """A fresh prompt of n tokens: flash uncapped, the capped kernel, torch's capped scores."""
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(n, h, D, generator=g, device=DEV).to(torch.bfloat16) for h in (HQ, HKV, HKV))
    cu = [0, n]
    cu_dev = torch.tensor(cu, dtype=torch.int32, device=DEV)
    heads = [x.transpose(0, 1)[None] for x in (q, k, v)]  # [1, H, n, D]
    cases = [("flash, uncapped", lambda: causal_attention(q, k, v, cu, D ** -0.5, cu_dev)),
             ("paged kernel, capped", lambda: capped_triton(q, k, v, cu, D ** -0.5, 0, CAP)),
             ("torch scores, capped", lambda: softcap.sdpa(*heads, D ** -0.5, CAP, causal=True))]
    rows, base = [], None
    for name, fn in cases:
        ms = bench(fn)
        base = base or ms
        line = f"fresh    {n} tokens, {name:22s} {ms * 1e3:9.1f} us  {ms / base:5.2f}x flash"
        say("  " + line)
        rows.append(line)
    return rows


def main() -> None:
    torch.manual_seed(0)
    if not SMOKE:
        p = torch.cuda.get_device_properties(0)
        say(f"{p.name}; torch {torch.__version__}; Hq={HQ} Hkv={HKV} D={D}, cap {CAP:g}")
    say("(a) correctness")
    ok = correctness()
    s, n = (2, 96) if SMOKE else (32, 4096)
    say(f"(b) decode: {s} x {n} keys")
    rows = timed("decode", [n] * s, [1] * s)
    say(f"(c) prefill: a chunk of {n // 4} rows after {n - n // 4} keys")
    rows += timed("prefill", [n], [n // 4])
    say(f"(d) a fresh prompt of {n} tokens")
    rows += fresh(n)
    sys.exit(summary("bench_softcap.log", ok, rows))


if __name__ == "__main__":
    main()
