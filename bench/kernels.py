"""Paged attention with RoPE on read, on CUDA: correctness, then timings.

(a) Both Triton kernels against the reference, fp32 and bf16, fresh random data.
(b) Qwen2.5-7B attention shape (Hq=28, Hkv=4, D=128, B=16, bf16): decode of 32
    sequences x 4096 context and prefill of 10 x 2048 tokens, against the reference and
    torch SDPA (flash) on dense, pre-rotated K/V; launch configurations swept.

    PYTHONPATH=<dir holding tokendance/> python bench/kernels.py [--smoke] [--decode] [--fp8]

--smoke runs tiny shapes under TRITON_INTERPRET=1 on the CPU (checks the script only);
--decode times the decode kernel only; --fp8 times it again over the same K/V held in an
8-bit pool (`--kv-cache-dtype fp8`, kernels/fp8.py), with wider tiles and deeper pipelines.
"""

from __future__ import annotations

import math
import os
import sys
import time
from functools import partial

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from tokendance.bench.kernel_timing import (  # noqa: E402
    COPY_CEILING, T0, kernel_stats, median_ms, rel, say, summary,
)
from tokendance.kernels import paged_attention as pa  # noqa: E402
from tokendance.kernels import paged_triton as pt  # noqa: E402
from tokendance.kernels.fp8 import FP8, narrow  # noqa: E402
from tokendance.kernels.rope import rope_rotate  # noqa: E402
from tokendance.kernels.tiles import trig_table  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
bench = partial(median_ms, smoke=SMOKE)
B = 16


def make(lens: list[int], q_pos: list[torch.Tensor], hq: int, hkv: int, d: int,
         dtype: torch.dtype, theta: float = 1e6) -> tuple:
    """Shuffled block tables; slots no sequence owns are NaN. A smoke run keeps one KV
    head of a group (the interpreter's time grows with the heads)."""
    if SMOKE:
        hq, hkv = hq // hkv, 1
    nblk = [(n + B - 1) // B for n in lens]
    total = sum(nblk) + 8
    kc = torch.full((total, B, hkv, d), math.nan, device=DEV, dtype=dtype)
    vc = torch.full_like(kc, math.nan)
    perm = torch.randperm(total, device=DEV)
    tables = torch.zeros(len(lens), max(nblk), dtype=torch.int32, device=DEV)
    at = 0
    for s, (n, nb) in enumerate(zip(lens, nblk)):
        ids = perm[at:at + nb]
        at += nb
        tables[s, :nb] = ids.int()
        flat_k, flat_v = kc[ids].flatten(0, 1), vc[ids].flatten(0, 1)
        flat_k[:n] = torch.randn(n, hkv, d, device=DEV, dtype=dtype)
        flat_v[:n] = torch.randn(n, hkv, d, device=DEV, dtype=dtype)
        kc[ids], vc[ids] = flat_k.view(nb, B, hkv, d), flat_v.view(nb, B, hkv, d)
    qp = torch.cat(q_pos).to(DEV)
    cu = torch.tensor([0] + [len(p) for p in q_pos], device=DEV).cumsum(0).int()
    q = torch.randn(len(qp), hq, d, device=DEV, dtype=dtype)
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=DEV).float() / d)
    return (q, qp, cu, kc, vc, tables, torch.tensor(lens, device=DEV, dtype=torch.int32),
            inv, 1.0, d ** -0.5)


def run_tri(args: tuple, **kw) -> torch.Tensor:
    out = torch.full_like(args[0], math.nan)
    return pa.paged_attention_triton(*args, out=out, **kw)


def check(name: str, args: tuple, **kw) -> bool:
    """Triton vs the reference in float64 on the same (possibly bf16-rounded) inputs."""
    a64 = tuple(t.double() if torch.is_tensor(t) and t.is_floating_point() else t for t in args)
    err = rel(run_tri(args, **kw), pa.paged_attention_reference(*a64))
    lim = 1e-3 if args[0].dtype == torch.float32 else 2e-2
    ok = err < lim
    say(f"  {name:46s} {str(args[0].dtype)[6:]:8s} rel {err:.2e}  {'ok' if ok else 'FAIL'}")
    return ok


def suffix(lens: list[int], nq: list[int]) -> list[torch.Tensor]:
    return [torch.arange(n - m, n) for n, m in zip(lens, nq)]


def correctness() -> bool:
    say("(a) correctness: Triton vs reference (rel err; fp32 < 1e-3, bf16 < 2e-2)")
    sc = 1 if SMOKE else 8
    ok = True
    for dt in (torch.float32, torch.bfloat16):
        L = [37 * sc, 10 * sc, 64 * sc]
        ok &= check("prefill 28/4 D128", make(L, suffix(L, L), 28, 4, 128, dt))
        ok &= check("prefill 9/3 D64", make(L, suffix(L, L), 9, 3, 64, dt))
        L = [90 * sc, 41 * sc]
        ok &= check("chunked prefill 28/4 D128", make(L, suffix(L, [13 * sc, 5]), 28, 4, 128, dt))
        pos = [torch.randperm(n)[:m] for n, m in zip(L, (20, 9))]
        ok &= check("scattered positions 9/3 D64", make(L, pos, 9, 3, 64, dt))
        L = [1, 17, 100 * sc, 500 * sc, 333]
        ok &= check("decode mixed lengths 28/4 D128", make(L, suffix(L, [1] * 5), 28, 4, 128, dt))
        ok &= check("decode mixed lengths 9/3 D64", make(L, suffix(L, [1] * 5), 9, 3, 64, dt))
        L = [200 if SMOKE else 32000, 100]  # RoPE angles far past 2 pi
        ok &= check("decode, long context, step=False",
                    make(L, suffix(L, [1, 1]), 28, 4, 128, dt), cfg=dict(step=False))
        ok &= check("chunk at long positions 28/4 D128",
                    make(L, suffix(L, [16 if SMOKE else 40, 3]), 28, 4, 128, dt))
    return ok


def sdpa_dense(args: tuple, causal: bool):
    """Dense pre-rotated K/V [S, Hkv, L, D] of equal lengths, and an SDPA call on them."""
    q, qp, cu, kc, vc, tab, lens, inv, rs, sm = args
    S, L = lens.numel(), int(lens[0])
    nq = q.shape[0] // S
    k = kc[tab.long()].flatten(1, 2)[:, :L]
    v = vc[tab.long()].flatten(1, 2)[:, :L]
    k = rope_rotate(k.flatten(0, 1), torch.arange(L, device=DEV).repeat(S), inv, rs)
    k = k.view(S, L, *k.shape[1:]).transpose(1, 2).contiguous()
    v = v.transpose(1, 2).contiguous()
    qd = q.view(S, nq, *q.shape[1:]).transpose(1, 2).contiguous()
    if SMOKE:
        return (lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=causal, scale=sm,
                                                       enable_gqa=True)), ""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(kk=k, vv=v, gqa=True):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qd, kk, vv, is_causal=causal, scale=sm,
                                                  enable_gqa=gqa)
    try:
        fn()
        return fn, ""
    except RuntimeError as e:  # flash without GQA support: repeat K/V (more bytes)
        say(f"  SDPA flash with enable_gqa failed ({str(e)[:80]}); K/V repeated")
        g = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        return (lambda: fn(kr, vr, False)), " (K/V repeated)"


def section(kind: str, args: tuple, base: dict, variants: list[tuple[dict, dict]],
            metric, deadline: float, sdpa: bool = True) -> list[str]:
    """Time the Triton launcher under each (cfg, kwargs) variant, the reference and (with
    `sdpa`) SDPA. metric(ms) -> the throughput column."""
    rows = []
    ref = pa.paged_attention_reference(*args)
    variants = variants[:2] if SMOKE else variants

    def row(name: str, ms: float, err: float | None = None) -> None:
        e = "" if err is None else f"  rel {err:.1e}"
        line = f"  {name:46s} {ms * 1e3:9.1f} us  {metric(ms)}{e}"
        say(line)
        rows.append(f"{kind:8s}{line.strip()}")

    for cfg, kw in variants:
        if time.time() - T0 > deadline:
            say(f"  (sweep cut at {deadline} s)")
            break
        c = {**base, **cfg}
        name = " ".join(f"{k.replace('block_', '').replace('num_', '')[:5]}={v if isinstance(v, str) else int(v)}"
                        for k, v in c.items()) + f" splits={kw.get('num_splits') or 'auto'}" * (
                            kind.startswith("decode"))
        try:
            fn = lambda: pa.paged_attention_triton(*args, cfg=c, **kw)  # noqa: E731
            row("triton " + name, bench(fn), rel(fn().float(), ref.float()))
        except Exception as e:  # keep sweeping: report what broke
            say(f"  {name}: ERROR {type(e).__name__}: {str(e)[:200]}")
    row("reference (torch, per-sequence loop)", bench(lambda: pa.paged_attention_reference(*args)))
    if not sdpa:
        return rows
    try:
        fn, note = sdpa_dense(args, causal=kind == "prefill")
        row("SDPA flash, dense pre-rotated K/V" + note, bench(fn))
    except Exception as e:
        say(f"  SDPA flash: ERROR {type(e).__name__}: {str(e)[:200]}")
    return rows


def timings() -> list[str]:
    Hq, Hkv, D = 28, 4, 128
    S, L = (2, 64) if SMOKE else (32, 4096)
    say(f"(b) decode: {S} x {L} context, Hq={Hq} Hkv={Hkv} D={D} bf16")
    args = make([L] * S, suffix([L] * S, [1] * S), Hq, Hkv, D, torch.bfloat16)
    kv_bytes = 2 * S * L * Hkv * D * 2

    def bandwidth(ms: float) -> str:
        bw = kv_bytes / (ms * 1e-3)
        return f"{bw / 1e12:5.2f} TB/s ({bw / COPY_CEILING:4.0%} of 4.1)"

    # step="table": keys rotated by rows of the cos/sin table instead of per-tile steps.
    trig = trig_table(args[7], L + 64)
    cfgs = [dict(), dict(step="table"), dict(step=False), dict(num_stages=3), dict(num_stages=4),
            dict(step="table", num_stages=3), dict(step="table", num_stages=4),
            dict(block_n=16), dict(block_n=16, step="table"), dict(block_n=64),
            dict(block_n=64, step="table"), dict(block_n=64, step="table", num_warps=8),
            dict(num_warps=2), dict(step="table", num_warps=2)]
    variants = [(c, dict(max_q=1, trig=trig)) for c in cfgs]
    variants += [(c, dict(max_q=1, trig=trig, num_splits=n))
                 for n in (4, 16) for c in (dict(), dict(step="table"))]
    rows = section("decode", args, pt.DECODE_CFG, variants, bandwidth, 240)
    if "--fp8" in sys.argv:
        # Half the bytes a tile: wider tiles and deeper pipelines keep as many in flight.
        say(f"(b) decode over an 8-bit pool (e4m3, the same values rounded): {S} x {L}")
        args = (*args[:3], narrow(args[3], FP8["fp8"]), narrow(args[4], FP8["fp8"]), *args[5:])
        kv_bytes //= 2
        cfgs = [dict(), dict(num_stages=3), dict(num_stages=4), dict(block_n=64), dict(block_n=64, num_stages=3),
                dict(block_n=64, num_stages=4), dict(block_n=128), dict(block_n=128, num_stages=3),
                dict(block_n=64, num_warps=8), dict(block_n=128, num_warps=8)]
        rows += section("decode8", args, pt.DECODE_CFG, [(c, dict(max_q=1, trig=trig)) for c in cfgs],
                        bandwidth, 480, sdpa=False)
    if "--decode" in sys.argv:
        return rows

    S, L = (1, 64) if SMOKE else (10, 2048)
    say(f"(b) prefill: {S} x {L} tokens from scratch, Hq={Hq} Hkv={Hkv} D={D} bf16")
    args = make([L] * S, suffix([L] * S, [L] * S), Hq, Hkv, D, torch.bfloat16)
    flops = 4 * Hq * D * S * L * (L + 1) / 2
    cfgs = [dict(), dict(step=False), dict(num_warps=4), dict(block_m=64, num_warps=4),
            dict(block_n=32, num_warps=4, num_stages=3), dict(block_n=128), dict(num_stages=3),
            dict(block_m=64, block_n=32, num_warps=4, num_stages=3)]
    variants = [(c, dict(max_q=L)) for c in cfgs]
    rows += section("prefill", args, pt.PREFILL_CFG, variants,
                    lambda ms: f"{flops / ms / 1e9:6.1f} TFLOP/s", 270)
    return rows


def copy_bandwidth() -> float:
    x = torch.empty(2 ** 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    return 2 * x.numel() / (bench(lambda: y.copy_(x)) * 1e-3)


def main() -> int:
    torch.manual_seed(0)
    if not SMOKE:
        p = torch.cuda.get_device_properties(0)
        say(f"{p.name}, {p.multi_processor_count} SMs; torch {torch.__version__}, "
            f"triton {triton.__version__}; copy {copy_bandwidth() / 1e12:.2f} TB/s (r+w)")
    ok = correctness()
    say(f"  correctness: {'all ok' if ok else 'FAILURES'} ({time.time() - T0:.0f} s)")
    rows = timings()
    if not SMOKE:
        kernel_stats((pt._prefill_kernel, pt._decode_kernel))
    return summary("bench_kernels.log", ok, rows)


if __name__ == "__main__":
    sys.exit(main())
