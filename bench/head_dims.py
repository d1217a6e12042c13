"""Head dims that are not a power of two, on CUDA (`bash bench/h200.sh headdims`).

The Triton kernels tile each half of a head as a power of two of columns and mask the
rest (kernels/jit.py `padded_half`); before, such a model ran its attention through the
torch references on the GPU, without CUDA graphs.

(a) The engine on the shapes of two such models, random weights: H2O Danube3-4B (head
    dim 120) and Danube2-1.8B (80): greedy tokens against HF transformers on the same
    weights, CUDA-graph decode against eager, and the Master read collectively against
    whole slot tables (bench/check_cuda.py's checks).
(b) The paged attention kernels at Danube3-4B's attention shape (32 query heads, 8 kv
    heads, bf16) against the reference in float64, then timed: decode of 32 x 4096
    context (inside a CUDA graph, as the engine replays it) and prefill of 10 x 2048, at
    head dims 128, 120 (the padded tile's width) and 100, and the reference at 120.
(c) With --baseline DIR|REV (an earlier checkout's kernels folder, or a git revision of
    this one): that checkout's paged kernels against this one's, alternating, at
    Qwen2.5-7B's attention shape (head dim 128: what a change costs a head that needs no
    padding) and at Danube3-4B's (120).

    python -m tokendance.bench.head_dims [--baseline DIR|REV] [--kernels-only] [--sweep] [--smoke]

--sweep times the decode kernel's launch configurations at head dims 128, 120 and 100
instead (decode in a graph, as in (b)).

--smoke runs (b) and (c) at tiny sizes under TRITON_INTERPRET=1 on the CPU (checks the
script only).
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from tokendance.bench.kernel_timing import COPY_CEILING, graph_ms, median_ms, say  # noqa: E402
from tokendance.bench.kernels import check, make, suffix  # noqa: E402
from tokendance.bench.ptx import load_baseline, resolve  # noqa: E402
from tokendance.kernels import paged_attention as pa  # noqa: E402
from tokendance.kernels.tiles import trig_table  # noqa: E402

SHAPES = ("danube3-4b", "danube2-1.8b")


def engine_checks() -> bool:
    from tokendance.bench.check_cuda import collective_vs_tables, graphs_vs_eager, greedy_vs_hf

    ok = True
    for shape in SHAPES:
        ok &= greedy_vs_hf("float32", shape)
        greedy_vs_hf("bfloat16", shape)  # informational, as for the other shapes
    for mirrors in (False, True):
        err = graphs_vs_eager(mirrors=mirrors, shape=SHAPES[0])
        say(f"CUDA-graph decode vs eager{' over Mirrors' if mirrors else ''} ({SHAPES[0]}), bf16: "
            f"relative error {err:.2e}")
        ok &= err < 2e-2
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 2e-2)):
        err = collective_vs_tables(dtype, SHAPES[0])
        say(f"Mirror decode ({SHAPES[0]}), Master read collectively vs whole slot tables, {dtype}: "
            f"relative error {err:.2e}")
        ok &= err < tol
    return ok


def kernel_checks() -> bool:
    ok = True
    sc = 8 if not SMOKE else 1
    for d in (120, 100, 80, 96) if not SMOKE else (120,):
        for dt in (torch.float32, torch.bfloat16):
            L = [37 * sc, 10 * sc, 64 * sc]
            ok &= check(f"prefill 32/8 D{d}", make(L, suffix(L, L), 32, 8, d, dt))
            L = [90 * sc, 41 * sc]
            ok &= check(f"chunked prefill 32/8 D{d}", make(L, suffix(L, [13 * sc, 5]), 32, 8, d, dt))
            L = [1, 17, 100 * sc, 500 * sc, 333]
            args = make(L, suffix(L, [1] * 5), 32, 8, d, dt)
            ok &= check(f"decode 32/8 D{d}, cos/sin table", args, max_q=1, trig=trig_table(args[7], 4100))
    return ok


# (sequences, tokens) of the timed decode and prefill
DECODE, PREFILL = ((2, 64), (1, 64)) if SMOKE else ((32, 4096), (10, 2048))


def decode_case(d: int, hq: int = 32, hkv: int = 8):
    s, n = DECODE
    args = make([n] * s, suffix([n] * s, [1] * s), hq, hkv, d, torch.bfloat16)
    return args, trig_table(args[7], n + 64), 2 * s * n * hkv * d * 2


def prefill_case(d: int, hq: int = 32, hkv: int = 8):
    s, n = PREFILL
    args = make([n] * s, suffix([n] * s, [n] * s), hq, hkv, d, torch.bfloat16)
    return args, 4 * hq * d * s * n * (n + 1) / 2


def timings() -> None:
    say("(b) Danube3-4B attention (32/8), bf16: head dims 128, 120 and 100 (halves padded to 64)")
    dec, pre = "%d x %d" % DECODE, "%d x %d" % PREFILL
    for d in (128, 120, 100):
        args, trig, nbytes = decode_case(d)
        out = torch.empty_like(args[0])
        ms = graph_ms(lambda: pa.paged_attention_triton(*args, max_q=1, trig=trig, out=out), SMOKE)
        say(f"  decode {dec}, D{d}: {ms * 1e3:7.1f} us a layer, {nbytes / ms / 1e9:5.2f} TB/s "
            f"({nbytes / ms * 1e3 / COPY_CEILING:4.0%} of the copy ceiling)")
        if d == 120:
            ref = median_ms(lambda: pa.paged_attention_reference(*args), SMOKE)
            say(f"  decode {dec}, D{d}, the torch reference: {ref * 1e3:9.1f} us ({ref / ms:.0f}x)")
        args, flops = prefill_case(d)
        ms = median_ms(lambda: pa.paged_attention_triton(*args, max_q=PREFILL[1]), SMOKE)
        say(f"  prefill {pre}, D{d}: {ms:7.2f} ms, {flops / ms / 1e9:6.1f} TFLOP/s")


def against(folder: str, rounds: int = 1 if SMOKE else 5) -> None:
    """This checkout's paged kernels against the baseline's, alternating, at head dims
    128 (Qwen2.5-7B's attention) and 120 (Danube3-4B's)."""
    old = load_baseline(folder)("paged_triton")
    new = importlib.import_module("tokendance.kernels.paged_triton")
    say(f"(c) this checkout against {folder}, bf16, medians of {rounds} alternating rounds")
    for d, hq, hkv in ((128, 28, 4), (120, 32, 8)):
        args, trig, _ = decode_case(d, hq, hkv)
        out = torch.empty_like(args[0])
        pre, _ = prefill_case(d, hq, hkv)
        cases = {
            f"D{d} ({hq}/{hkv}) decode %d x %d (us, in a graph)" % DECODE: lambda m: graph_ms(
                lambda: m.paged_attention_triton(*args, max_q=1, trig=trig, out=out), SMOKE) * 1e3,
            f"D{d} ({hq}/{hkv}) prefill %d x %d (ms)" % PREFILL: lambda m: median_ms(
                lambda: m.paged_attention_triton(*pre, max_q=PREFILL[1]), SMOKE),
        }
        for name, run in cases.items():
            times = {"this": [], "baseline": []}
            for _ in range(rounds):
                times["this"].append(run(new))
                times["baseline"].append(run(old))
            a, b = statistics.median(times["this"]), statistics.median(times["baseline"])
            say(f"  {name}: this {a:.2f}, baseline {b:.2f}: {a / b:.3f}x the baseline's time")


SWEEP = [dict(block_n=n, num_warps=w, num_stages=st) for n, w, st in
         ((32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 8, 2), (16, 4, 2), (32, 2, 2))]


def sweep() -> None:
    """Decode's launch configurations (`--sweep`), µs a layer in a graph."""
    say("decode %d x %d, 32/8, bf16: us a layer per launch configuration (block_n, warps, stages)" % DECODE)
    say("| head dim | " + " | ".join(f"{c['block_n']} w{c['num_warps']} s{c['num_stages']}" for c in SWEEP)
        + " |\n|---|" + "---|" * len(SWEEP))
    for d in (128, 120, 100):
        args, trig, _ = decode_case(d)
        out = torch.empty_like(args[0])
        times = [graph_ms(lambda c=c: pa.paged_attention_triton(*args, max_q=1, trig=trig, out=out, cfg=c),
                          SMOKE) * 1e3 for c in SWEEP]
        say(f"| {d} | " + " | ".join(f"{t:.1f}" for t in times) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="an earlier checkout's kernels folder, or a git revision, to time against")
    p.add_argument("--kernels-only", action="store_true", help="skip (a), the engine's checks")
    p.add_argument("--smoke", action="store_true", help="(b) and (c) tiny, interpreted on the CPU")
    p.add_argument("--sweep", action="store_true", help="only decode's launch configurations, timed")
    a = p.parse_args()
    if a.sweep:
        sweep()
        return 0
    if a.baseline:  # before any of the GPU's time goes
        try:
            a.baseline = resolve(a.baseline)
        except ValueError as exc:
            print(f"--baseline: {exc}", file=sys.stderr)
            return 2
    torch.manual_seed(0)
    ok = True
    if not (a.kernels_only or a.smoke):
        say("(a) the engine at head dims 120 and 80")
        ok &= engine_checks()
    say("(b) the kernels against the reference (rel err; fp32 < 1e-3, bf16 < 2e-2)")
    ok &= kernel_checks()
    timings()
    if a.baseline:
        against(a.baseline)
    say(f"correctness: {'all ok' if ok else 'FAILURES'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
