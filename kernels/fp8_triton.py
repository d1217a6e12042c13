"""The Triton kernels of 8-bit weights (kernels/fp8_linear.py holds their references and the
module that calls them):

- `quantize_rows_triton`: each row rounded to e4m3 under its own scale in one launch (the
  row read twice: its largest magnitude, then the rounding), where torch's ops took eight
  launches and float32 copies of the row (1,151 us against 824 for the bf16 layer it fed,
  4,096 rows of 18,944; 13-16 us for one row: bench/fp8_linear.py, H100);
- `few_rows_triton`: the product of a few rounded rows (a decode step's) and the e4m3
  weight, streaming the weight once: `torch._scaled_mm`'s tiles are made for many rows and
  read a weight at 0.5-1.8 TB/s for one row, where bf16's `F.linear` reads 2.6-3.6.

The rows kernel also rounds under a checkpoint's static input scale (an FP8 checkpoint
calibrated so; backend/quant.py). Both compute the reference's function, the rows' rounding bit for bit (a quotient rounded
as IEEE rounds it: div_rn), the product accumulated in float32.
"""

from __future__ import annotations

import torch

from tokendance.kernels.fp8 import FP8, limit
from tokendance.kernels.jit import launch_options, tl, triton

E4M3 = FP8["fp8"]
TOP = limit(E4M3)  # 448.0
# A row's scale is its largest magnitude times 1/448 (in float32): a product rounds alike
# everywhere, where torch on CUDA divides a tensor by a number as this product and on the
# CPU as a quotient (their scales differed in the last bit, and so did some bytes).
INV_TOP = 1.0 / TOP
TINY = 1e-12
# Columns a rows program reads at once: a whole row of Qwen2.5-7B's 3,584 in one pass, its
# MLP's 18,944 in five (a row of 1,024 columns at a time took 10.6-11.7 us there: bench/fp8_linear.py)
ROWS_BLOCK = 4096
# Best at 1-16 rows at Qwen2.5-7B's widths on an H100 (of 7 launches, bench/fp8_linear.py)
FEW_CFG = dict(block_n=32, block_k=256, num_warps=4, num_stages=4)


@triton.jit
def _rows_kernel(x, q, scale, fixed, K, s_x, s_q, TOP: tl.constexpr, INV_TOP: tl.constexpr, TINY: tl.constexpr,
                 BLOCK: tl.constexpr, STATIC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if STATIC:  # a checkpoint's input scale, the same for every row
        s = tl.load(fixed)
    else:
        top = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            v = tl.load(x + row * s_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            top = tl.maximum(top, tl.abs(v))
        s = tl.maximum(tl.max(top, 0), TINY) * INV_TOP
    for k0 in range(0, K, BLOCK):
        m = k0 + offs < K
        v = tl.load(x + row * s_x + k0 + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(q + row * s_q + k0 + offs, tl.clamp(tl.math.div_rn(v, s), -TOP, TOP), mask=m)
    tl.store(scale + row, s)


def quantize_rows_triton(x: torch.Tensor, fixed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_linear.quantize_rows` of a 2-D x (rows contiguous) in one launch; under `fixed`
    (a float32 scalar) for every row where given."""
    assert x.dim() == 2 and x.stride(-1) == 1
    m, k = x.shape
    q = torch.empty(m, k, device=x.device, dtype=E4M3)
    scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    if m:
        block = min(ROWS_BLOCK, triton.next_power_of_2(k))
        _rows_kernel[(m,)](x, q, scale, scale if fixed is None else fixed, k, x.stride(0), q.stride(0), TOP=TOP,
                           INV_TOP=INV_TOP, TINY=TINY, BLOCK=block, STATIC=fixed is not None,
                           num_warps=8 if block >= 2048 else 4)
    return q, scale


@triton.jit
def _few_kernel(xq, xs, w, ws, bias, out, M, N, K, s_x, s_w, s_o, HAS_BIAS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rm, cn = rows < M, cols < N
    a_ptr = xq + rows[:, None].to(tl.int64) * s_x + ks[None, :]
    b_ptr = w + cols[:, None].to(tl.int64) * s_w + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mk = (k0 + ks < K)[None, :]
        # float16 holds e4m3 exactly, two values a conversion instruction
        a = tl.load(a_ptr + k0, mask=rm[:, None] & mk, other=0.0).to(tl.float16)
        b = tl.load(b_ptr + k0, mask=cn[:, None] & mk, other=0.0).to(tl.float16)
        acc = tl.dot(a, tl.trans(b), acc)
    acc = acc * tl.load(xs + rows, mask=rm, other=0.0)[:, None] * tl.load(ws + cols, mask=cn, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=cn, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rows[:, None].to(tl.int64) * s_o + cols[None, :], acc, mask=rm[:, None] & cn[None, :])


def few_rows_triton(xq: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                    cfg: dict | None = None) -> torch.Tensor:
    """(xq * xs) @ (w8 * w_scale).T (+ bias) for rounded rows xq [M, K] (scales [M, 1]) and
    an e4m3 weight [N, K] (scales [N, 1]), in `out_dtype`; made for M of a decode step."""
    m, k = xq.shape
    n = w8.shape[0]
    assert w8.shape[1] == k and xq.stride(-1) == w8.stride(-1) == 1
    c = {**FEW_CFG, **(cfg or {})}
    out = torch.empty(m, n, device=xq.device, dtype=out_dtype)
    block_m = 16  # tl.dot's fewest rows
    grid = (triton.cdiv(n, c["block_n"]), triton.cdiv(m, block_m))
    _few_kernel[grid](xq, xs, w8, w_scale, bias if bias is not None else w_scale, out, m, n, k,
                      xq.stride(0), w8.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m,
                      BLOCK_N=c["block_n"], BLOCK_K=c["block_k"], **launch_options(c))
    return out
