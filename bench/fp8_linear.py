"""Where 8-bit weights (`--quantization fp8`, kernels/fp8_linear.py) spend a layer's time:
at Qwen2.5-7B's widths (qkv 3584 -> 4608, o 3584 -> 3584, gate_up 3584 -> 37888, down 18944
-> 3584) and decode to prefill row counts, in CUDA graphs of 28 calls (a step's layers, each
its own copy of the weights, read from memory as a step reads them, not found in the L2;
before session 67 one weight was read 28 times over), medians of 30 replays:

- bf16: `F.linear` on the bf16 weight (the baseline);
- rows: the inputs' rows rounded to e4m3, torch's ops (`quantize_rows`) and the Triton
  kernel (`quantize_rows_triton`);
- scaled_mm: `torch._scaled_mm` alone on inputs rounded beforehand;
- few: the few-rows kernel alone (`few_rows_triton`, up to 32 rows), the best of a few
  launch configurations (named);
- fp8: the whole layer as the engine runs it (`fp8_linear`).

    PYTHONPATH=<dir holding tokendance/> python bench/fp8_linear.py [--smoke]

--smoke runs tiny shapes under TRITON_INTERPRET=1 on the CPU (checks the script only).
"""

from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tokendance.bench.kernel_timing import LAUNCHES, each, graph_ms, layers, rel, say, summary  # noqa: E402
from tokendance.kernels import fp8_linear as fl  # noqa: E402
from tokendance.kernels import fp8_triton as ft  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
SHAPES = ({"qkv": (64, 96), "down": (160, 64)} if SMOKE else
          {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)})
ROWS = (1, 17) if SMOKE else (1, 8, 16, 32, 512, 4096)
FEW = [dict(), dict(block_n=16), dict(block_k=512, num_stages=3), dict(block_n=32, block_k=128),
       dict(block_n=64, block_k=128), dict(num_warps=8), dict(block_k=128, num_stages=6)][: 2 if SMOKE else None]


def few(xq, xs, sets, want) -> tuple[float, str, bool]:
    """The few-rows kernel's best time (us) over FEW, its configuration, and whether every
    configuration computed the reference's product."""
    best, name, ok = float("inf"), "", True
    for cfg in FEW:
        ok &= rel(ft.few_rows_triton(xq, xs, *sets[0][1:], cfg=cfg), want) < 2e-2
        t = graph_ms(each(lambda _, w8, ws: ft.few_rows_triton(xq, xs, w8, ws, cfg=cfg), sets), SMOKE) * 1e3
        if t < best:
            best, name = t, " ".join(f"{k}={v}" for k, v in {**ft.FEW_CFG, **cfg}.items())
    return best, name, ok


def main() -> int:
    torch.manual_seed(0)
    say(f"{'cpu' if SMOKE else torch.cuda.get_device_name()}; torch {torch.__version__}")
    out = ["| layer | rows | bf16 us | rows torch / triton us | scaled_mm us | few us (best launch) | fp8 us | "
           "fp8 / bf16 | weight TB/s bf16 / fp8 |", "|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k ** 0.5
        w8, ws = fl.quantize_rows(w)
        sets = layers((w, w8, ws), 1 if SMOKE else LAUNCHES)
        for rows in ROWS:
            x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
            xq, xs = fl.quantize_rows(x)
            want = fl.fp8_linear_reference(x.float(), w8, ws)
            ok &= rel(fl.fp8_linear(x, w8, ws), want) < 2e-2
            t = [graph_ms(each(fn, sets), SMOKE) * 1e3 for fn in (
                lambda w, *_: F.linear(x, w),
                lambda *_: fl.quantize_rows(x),
                lambda *_: ft.quantize_rows_triton(x),
                lambda _, w8, ws: torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=ws.view(1, -1),
                                                   out_dtype=torch.bfloat16),
                lambda _, w8, ws: fl.fp8_linear(x, w8, ws))]
            f, cfg, good = few(xq, xs, sets, want) if rows <= 32 else (float("nan"), "", True)
            ok &= good
            out.append(f"| {name} | {rows} | {t[0]:.1f} | {t[1]:.1f} / {t[2]:.1f} | {t[3]:.1f} | {f:.1f} ({cfg}) | "
                       f"{t[4]:.1f} | {t[4] / t[0]:.2f}x | {2 * n * k / t[0] / 1e6:.2f} / {n * k / t[4] / 1e6:.2f} |")
            say(out[-1])
    return summary("bench_fp8_linear.log", ok, out)


if __name__ == "__main__":
    sys.exit(main())
