"""Block-wise 8-bit weights (an FP8 checkpoint's `weight_block_size` [128, 128],
kernels/fp8_block.py) against bf16 weights and per-row 8-bit ones, at Qwen3-8B's widths
(qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 24576, down 12288 -> 4096) and decode
to prefill row counts, in CUDA graphs of 28 calls (a step's layers), medians of 30
replays; each checked against its float32 reference first:

- bf16: `F.linear` on the bf16 weight (the baseline);
- rows: per-row scales as `--quantization fp8` holds them (`fp8_linear`: the few-rows
  kernel or `torch._scaled_mm`);
- block: the whole layer as the engine runs it (`block_linear`: groups rounded by the rows
  kernel, then the Triton block product).

    PYTHONPATH=<dir holding tokendance/> python bench/fp8_block.py [--smoke]

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

from tokendance.bench.kernel_timing import graph_ms, rel, say, summary  # noqa: E402
from tokendance.kernels import fp8_block as fb  # noqa: E402
from tokendance.kernels import fp8_linear as fl  # noqa: E402
from tokendance.kernels.fp8_block_triton import block_linear_triton  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
BLOCK = (32, 32) if SMOKE else (128, 128)
SHAPES = ({"qkv": (64, 96), "down": (128, 64)} if SMOKE else
          {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)})
ROWS = (1, 17) if SMOKE else (1, 8, 32, 512, 4096)


def block_layer(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """`block_linear` as a GPU runs it; under the interpreter its Triton path by hand (the
    engine's `fast` test wants CUDA)."""
    if not SMOKE:
        return fb.block_linear(x, w8, ws, BLOCK)
    xq, xs = fb.quantize_groups(x, BLOCK[1])
    return block_linear_triton(xq, xs, w8, ws, BLOCK)


def main() -> int:
    torch.manual_seed(0)
    say(f"{'cpu' if SMOKE else torch.cuda.get_device_name()}; torch {torch.__version__}; blocks {BLOCK}")
    out = ["| layer | rows | bf16 us | rows fp8 us | block fp8 us | rows / bf16 | block / bf16 | block / rows |",
           "|---|---|---|---|---|---|---|---|"]
    ok = True
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k ** 0.5
        w8, ws = fl.quantize_rows(w)
        b8, bs = fb.quantize_blocks(w, *BLOCK)
        for rows in ROWS:
            x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
            ok &= rel(fl.fp8_linear(x, w8, ws), fl.fp8_linear_reference(x.float(), w8, ws)) < 2e-2
            ok &= rel(block_layer(x, b8, bs), fb.block_linear_reference(x.float(), b8, bs, BLOCK)) < 2e-2
            t = [graph_ms(fn, SMOKE) * 1e3 for fn in (
                lambda: F.linear(x, w), lambda: fl.fp8_linear(x, w8, ws), lambda: block_layer(x, b8, bs))]
            out.append(f"| {name} | {rows} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} | {t[1] / t[0]:.2f}x | "
                       f"{t[2] / t[0]:.2f}x | {t[2] / t[1]:.2f}x |")
            say(out[-1])
    return summary("bench_fp8_block.log", ok, out)


if __name__ == "__main__":
    sys.exit(main())
