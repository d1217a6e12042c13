"""Collective decode attention on CUDA: correctness on the real shape, then timings.

Qwen2.5-7B attention shape (Hq=28, Hkv=4, D=128, B=16, bf16), a shared Master of 2,048
tokens, N = 10 and 20 Mirrors each hiding ~15 % of its Master slots. Per layer:

(a) collective_attention over the N Mirrors (Master read once), launch configs swept;
(b) paged decode over N dense copies of the 2k shared part (N sequences, own blocks);
(c) paged decode over ONE dense 2k cache (the floor (a) aims at: (a)/(c) <= 1.1).
Each timed as the engine runs it: 28 calls (a step's layers) in one CUDA graph, the
median of 30 replays, per call; every case rotates by rows of the cos/sin table.

    PYTHONPATH=<dir holding tokendance/> python bench/collective.py [--smoke] [--fp8]

--smoke runs tiny shapes under TRITON_INTERPRET=1 on the CPU (checks the script only);
--fp8 holds the pool's K/V in e4m3 (`--kv-cache-dtype fp8`, kernels/fp8.py).
"""

from __future__ import annotations

import math
import os
import sys
import time
from functools import partial

SMOKE = "--smoke" in sys.argv
FP8 = "--fp8" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from tokendance.bench.kernel_timing import (  # noqa: E402
    COPY_CEILING, T0, graph_ms, kernel_stats, rel, save_log, say,
)
from tokendance.kernels import collective as col  # noqa: E402
from tokendance.kernels import collective_triton as colt  # noqa: E402
from tokendance.kernels import paged_triton as pt  # noqa: E402
from tokendance.kernels.fp8 import FP8 as FORMATS, narrow  # noqa: E402
from tokendance.kernels.tiles import trig_table  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
bench = partial(graph_ms, smoke=SMOKE)
B = 16
HQ, HKV, D = (7, 1, 128) if SMOKE else (28, 4, 128)  # smoke: one KV head of a group, interpreted
M = 64 if SMOKE else 2048
NS = (2, 3) if SMOKE else (10, 20)


def setup(n: int, dtype: torch.dtype = torch.bfloat16, theta: float = 1e6) -> dict:
    """One pool: the Master's blocks and N dense copies of it, shuffled; spare blocks NaN.
    Returns the argument tuples of (a), (b) and (c)."""
    nb = M // B
    total = nb * (n + 1) + 8
    kc = torch.full((total, B, HKV, D), math.nan, device=DEV, dtype=dtype)
    vc = torch.full_like(kc, math.nan)
    perm = torch.randperm(total, device=DEV)
    master = perm[:nb].int()
    kc[master] = torch.randn(nb, B, HKV, D, device=DEV, dtype=dtype)
    vc[master] = torch.randn(nb, B, HKV, D, device=DEV, dtype=dtype)
    copies = perm[nb:nb * (n + 1)].view(n, nb).int()
    for s in range(n):
        kc[copies[s]], vc[copies[s]] = kc[master], vc[master]
    if FP8:
        kc, vc = narrow(kc, FORMATS["fp8"]), narrow(vc, FORMATS["fp8"])
    inv = 1.0 / theta ** (torch.arange(0, D, 2, device=DEV).float() / D)
    sm = D ** -0.5
    shift = torch.randint(0, 3000, (n,), device=DEV)
    q_pos = shift + M + torch.randint(1, 300, (n,), device=DEV)
    hide = torch.rand(n, M, device=DEV) < 0.15
    q = torch.randn(n, HQ, D, device=DEV, dtype=dtype)
    a = (q, q_pos, shift, kc, vc, master, M, hide, inv, 1.0, sm)
    trig = trig_table(inv, 8192)
    cu = torch.arange(n + 1, device=DEV, dtype=torch.int32)
    lens = torch.full((n,), M, device=DEV, dtype=torch.int32)
    last = torch.full((n,), M - 1, device=DEV)
    b = (q, last, cu, kc, vc, copies, lens, inv, 1.0, sm)
    c = (q[:1], last[:1], cu[:2], kc, vc, master[None], lens[:1], inv, 1.0, sm)
    return dict(a=a, b=b, c=c, trig=trig)


def check(n: int, args: tuple) -> bool:
    """Triton vs the reference (fp32 math on the same bf16 inputs)."""
    o, lse = col.collective_attention_reference(*args)
    got_o, got_lse = colt.collective_attention_triton(*args)
    err = rel(got_o, o)
    fin = lse.isfinite()
    same_inf = torch.equal(got_lse.isinf(), lse.isinf())
    lse_err = (got_lse[fin] - lse[fin]).abs().max().item() if fin.any() else 0.0
    ok = err < 2e-2 and same_inf and lse_err < 5e-2
    say(f"  N={n:3d}: o rel err {err:.2e}, lse max abs err {lse_err:.2e}"
        f"{'' if same_inf else ', -inf rows differ'}  {'ok' if ok else 'FAIL'}")
    return ok


def sweep(n: int, args: tuple, trig: torch.Tensor, ref: torch.Tensor,
          deadline: float) -> tuple[float, str]:
    """Time (a) under a few launch configs; the best (ms, name)."""
    w8 = dict(num_warps=8)
    variants = [({}, None), (dict(block_n=32), None), (dict(block_n=32, **w8), None),
                (dict(block_m=32), None), (dict(block_m=64), None), (dict(block_m=64, **w8), None),
                ({}, 8), ({}, 32), (dict(block_n=32), 32)]
    if FP8:  # the kernel takes 154 registers a thread over e4m3 values, 114 over bf16 (bench/ptx.py)
        variants += [(dict(maxnreg=128), None), (dict(block_m=32, maxnreg=128), None)]
    if SMOKE:
        variants = [variants[0], variants[2], variants[5], *variants[9:10]]
    best = (math.inf, "")
    for cfg, splits in variants:
        if time.time() - T0 > deadline:
            say(f"  (sweep cut at {deadline:.0f} s)")
            break
        c = {**colt.COLLECTIVE_CFG, **cfg}
        tiles, bm = colt.row_tiles(n * (HQ // HKV), c["block_m"])
        ns = splits or colt._num_splits(torch.device(DEV), tiles * HKV, M, c["block_n"])
        name = (f"m={bm}x{tiles} n={c['block_n']} warps={c['num_warps']} "
                f"stages={c['num_stages']} splits={ns}" + (f" regs<={c['maxnreg']}" if c.get("maxnreg") else ""))
        try:
            fn = lambda: colt.collective_attention_triton(*args, cfg=c, num_splits=ns, trig=trig)  # noqa: E731
            err = rel(fn()[0], ref)
            ms = bench(fn)
        except Exception as e:  # keep sweeping: report what broke
            say(f"  {name}: ERROR {type(e).__name__}: {str(e)[:200]}")
            continue
        say(f"  (a) {name:44s} {ms * 1e3:8.1f} us  rel {err:.1e}")
        if err < 2e-2 and ms < best[0]:
            best = (ms, name)
    return best


def kv_bytes(n_copies: int) -> int:
    return 2 * n_copies * M * HKV * D * (1 if FP8 else 2)


def main() -> None:
    torch.manual_seed(0)
    if not SMOKE:
        p = torch.cuda.get_device_properties(0)
        say(f"{p.name}, {p.multi_processor_count} SMs; torch {torch.__version__}, "
            f"triton {triton.__version__}")
    say(f"Hq={HQ} Hkv={HKV} D={D} B={B} bf16, {'e4m3' if FP8 else 'bf16'} pool, Master {M} tokens, "
        "15 % hidden per Mirror")
    ok, rows = True, []
    for i, n in enumerate(NS):
        case = setup(n)
        say(f"N = {n}: correctness, (a) vs reference")
        ok &= check(n, case["a"])
        ref = col.collective_attention_reference(*case["a"])[0]
        a_ms, a_name = sweep(n, case["a"], case["trig"], ref, deadline=45 + 45 * i)
        b_ms = bench(lambda args=case["b"]: pt.paged_attention_triton(*args, max_q=1, trig=case["trig"]))
        c_ms = bench(lambda args=case["c"]: pt.paged_attention_triton(*args, max_q=1, trig=case["trig"]))
        say(f"  (b) paged, {n} dense copies {b_ms * 1e3:8.1f} us; "
            f"(c) paged, one copy {c_ms * 1e3:8.1f} us; best (a): {a_name}")
        hide_bytes = n * M
        rotated = kv_bytes(1) * (2 if FP8 else 1)  # the rotated keys (bf16), written to a workspace and read
        for label, ms, nbytes in (("(a) collective", a_ms, kv_bytes(1) + hide_bytes + rotated),
                                  ("(b) paged, N copies", b_ms, kv_bytes(n)),
                                  ("(c) paged, one copy", c_ms, kv_bytes(1))):
            bw = nbytes / (ms * 1e-3)
            rows.append(f"| {n} | {label} | {ms:.4f} | {ms / c_ms:.2f} | {nbytes / 1e6:.1f} | "
                        f"{bw / 1e12:.2f} | {bw / COPY_CEILING:.0%} |")
    if not SMOKE:
        kernel_stats((colt._rotate_kernel, colt._collective_kernel, colt._merge_kernel))
    table = ["| N | case | ms | vs (c) | MB moved | TB/s | of 4.1 TB/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"] + rows
    say("\n==== summary ====")
    say(f"correctness: {'all ok' if ok else 'FAILURES'}")
    for line in table:
        say(line)
    say(f"goal: (a)/(c) <= 1.1. MB moved: Master K/V (+ hide masks and rotated keys for (a)); total "
        f"{time.time() - T0:.0f} s")
    save_log("bench_collective.log")


if __name__ == "__main__":
    main()
