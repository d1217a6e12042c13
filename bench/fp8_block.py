"""Block-wise 8-bit weights (an FP8 checkpoint's `weight_block_size` [128, 128],
kernels/fp8_block.py) against bf16 weights and per-row 8-bit ones, at Qwen3-8B's widths
(qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 24576, down 12288 -> 4096) and decode
to prefill row counts, in CUDA graphs of 28 calls (a step's layers, each its own copy of
the weights, read from memory as a step reads them, not found in the L2), medians of 30 replays; each checked against its
float32 reference first:

- bf16: `F.linear` on the bf16 weight (the baseline);
- rows: per-row scales as `--quantization fp8` holds them (`fp8_linear`: the few-rows
  kernel or `torch._scaled_mm`);
- block: the whole layer as the engine runs it (`block_linear`: groups rounded by the rows
  kernel, then the product it picks);
- triton: the groups rounded the same way, then the Triton product (e4m3 operands; its
  configuration for the row count: K split for a decode step's few rows, programs grouped
  by row tiles for more);
- s65: the same with session 65's Triton product (float16 operands, K whole, tiles of 16 x
  64 for up to 16 rows, else of 64 x 128 in row-tile order);
- cublas: the groups rounded the same way, then torch's block-scaled `F.scaled_mm`
  (`fp8_block.cublas`), where this torch and GPU take it.

    PYTHONPATH=<dir holding tokendance/> python bench/fp8_block.py [--smoke] [--sweep] [--rows 1,8,...]

--sweep also times the Triton product's launch configurations: a decode step's few rows
(one row tile, K split or not) and more rows (tiles of 32 to 64 rows grouped); --rows
picks the row counts.
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
from tokendance.kernels import fp8_block as fb  # noqa: E402
from tokendance.kernels import fp8_linear as fl  # noqa: E402
from tokendance.kernels.fp8_block_triton import FEW, MANY, MID, MID_ROWS, block_linear_triton  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
BLOCK = (32, 32) if SMOKE else (128, 128)
SHAPES = ({"qkv": (64, 96), "down": (128, 64)} if SMOKE else
          {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)})
ROWS = (1, 17) if SMOKE else (1, 8, 32, 128, 512, 4096)
if "--rows" in sys.argv:
    ROWS = tuple(int(r) for r in sys.argv[sys.argv.index("--rows") + 1].split(","))
OLD = {few: dict(block_m=16 if few else 64, block_n=64 if few else 128, num_warps=4 if few else 8, num_stages=3,
                group_m=1, split_k=1, e4m3_dot=False) for few in (True, False)}  # session 65's
SWEEPS = {  # block_m, block_n, warps, stages, group_m, split_k
    "few": [(16, 64, 4, 3, 1, 1), (16, 32, 4, 4, 1, 1), (16, 32, 4, 6, 1, 1), (16, 64, 4, 5, 1, 1),
            (16, 128, 4, 3, 1, 1), (16, 32, 2, 4, 1, 1), (16, 64, 4, 3, 1, 2), (16, 64, 4, 3, 1, 4),
            (16, 32, 4, 4, 1, 2), (16, 128, 4, 4, 1, 4), (16, 64, 4, 4, 1, 8)],
    "many": [(64, 128, 4, 4, 8, 1), (64, 64, 4, 4, 8, 1), (32, 64, 4, 4, 8, 1), (32, 128, 4, 4, 8, 1),
             (64, 64, 4, 3, 8, 1), (64, 64, 4, 4, 8, 2), (32, 64, 4, 4, 8, 2), (16, 64, 4, 4, 1, 1)]}
SWEEPS = {kind: [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s, group_m=g, split_k=k)
                 for bm, bn, w, s, g, k in cfgs[:2 if SMOKE else None]] for kind, cfgs in SWEEPS.items()}


def label(c: dict) -> str:
    return (f"{c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['num_stages']} g{c['group_m']}"
            + (f" k{c['split_k']}" if c["split_k"] > 1 else ""))


def rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fb.quantize_groups(x, BLOCK[1]) if SMOKE else fb.round_groups(x, BLOCK[1])


def product(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """The layer through the Triton product with `cfg` (the rounding as the engine's)."""
    return block_linear_triton(*rounded(x), w8, ws, BLOCK, cfg=cfg)


def layer(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """`block_linear` as a GPU runs it (the interpreter's `fast` is false: the Triton path)."""
    return product(x, w8, ws) if SMOKE else fb.block_linear(x, w8, ws, BLOCK)


def through_torch(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor) -> torch.Tensor | None:
    """The layer through torch's block-scaled product (`cublas`), or None where this torch or
    GPU takes none (why, said once)."""
    got = None if SMOKE else fb.cublas(x, w8, ws, BLOCK)
    if got is None and not getattr(through_torch, "said", False):
        through_torch.said = True
        why = "the interpreter" if SMOKE else fb.cublas_refusal(x.device) or (
            f"torch {torch.__version__} has no F.scaled_mm" if not hasattr(F, "scaled_mm") else "untried")
        say(f"torch's block-scaled product not taken: {why}")
    return got


def main() -> int:
    torch.manual_seed(0)
    say(f"{'cpu' if SMOKE else torch.cuda.get_device_name()}; torch {torch.__version__}; blocks {BLOCK}")
    out = ["| layer | rows | bf16 us | rows fp8 us | block us | triton us | s65 us | cublas us | rows / bf16 "
           "| block / bf16 | triton / s65 | cublas / triton |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    sweeps = {kind: ["| layer | rows | " + " | ".join(map(label, cfgs)) + " |", "|---|---|" + "---|" * len(cfgs)]
              for kind, cfgs in SWEEPS.items()}
    ok = True
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k ** 0.5
        w8, ws = fl.quantize_rows(w)
        b8, bs = fb.quantize_blocks(w, *BLOCK)
        sets = layers((w, w8, ws, b8, bs), 1 if SMOKE else LAUNCHES)
        for rows in ROWS:
            x, old = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16), OLD[rows <= FEW["block_m"]]
            want = fb.block_linear_reference(x.float(), b8, bs, BLOCK)
            ok &= rel(fl.fp8_linear(x, w8, ws), fl.fp8_linear_reference(x.float(), w8, ws)) < 2e-2
            for fn in (layer, product, lambda *a: product(*a, old)):
                ok &= rel(fn(x, b8, bs), want) < 2e-2
            cub = (got := through_torch(x, b8, bs)) is not None
            ok &= not cub or rel(got, want) < 2e-2
            fns = [lambda w, *_: F.linear(x, w), lambda _, w8, ws, *__: fl.fp8_linear(x, w8, ws),
                   lambda *t: layer(x, *t[3:]), lambda *t: product(x, *t[3:]), lambda *t: product(x, *t[3:], old)]
            fns += [lambda *t: through_torch(x, *t[3:])] * cub
            t = [graph_ms(each(fn, sets), SMOKE) * 1e3 for fn in fns] + [float("nan")] * (not cub)
            out.append(f"| {name} | {rows} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} | {t[3]:.1f} | {t[4]:.1f} | "
                       f"{t[5]:.1f} | {t[1] / t[0]:.2f}x | {t[2] / t[0]:.2f}x | {t[3] / t[4]:.2f}x | "
                       f"{t[5] / t[3]:.2f}x |")
            say(out[-1])
            if "--sweep" in sys.argv:
                kind = "few" if rows <= FEW["block_m"] else "many"
                for c in SWEEPS[kind]:
                    ok &= rel(product(x, b8, bs, c), want) < 2e-2
                ts = [graph_ms(each(lambda *t, c=c: product(x, *t[3:], c), sets), SMOKE) * 1e3 for c in SWEEPS[kind]]
                sweeps[kind].append(f"| {name} | {rows} | " + " | ".join(f"{v:.1f}" for v in ts) + " |")
                say(sweeps[kind][-1])
    tables = [line for table in sweeps.values() if len(table) > 2 for line in ["", *table]]
    return summary("bench_fp8_block.log", ok, out + tables + [
        f"the block product's configurations: few rows {FEW} (K split by the SM count), up to {MID_ROWS} rows {MID}, "
        f"more {MANY}"])


if __name__ == "__main__":
    sys.exit(main())
