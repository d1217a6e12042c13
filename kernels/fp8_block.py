"""Linear layers with block-wise 8-bit float weights, as FP8 checkpoints of Qwen3 and
DeepSeek store them (`weight_block_size` [bn, bk], compressed-tensors' `block` strategy):
the e4m3 weight [N, K] takes one float32 scale per bn x bk block ([N / bn, K / bk]); each
input row is rounded per group of bk columns at run time, each group under a scale of its
own (its largest magnitude maps to e4m3's 448). The product accumulates each k-block in
float32 and takes its two scales there.

On a GPU with FP8 tensor cores the groups are rounded by kernels/fp8_triton.py's rows
kernel (a group is a row of bk columns) and the product is `block_linear_triton`
(kernels/fp8_block_triton.py), or for more than MID_ROWS rows over 128 x 128 blocks torch's
own (`cublas`: on an H100, from 128 rows on as fast as Triton's best or faster, o's
projection at 128 rows aside; docs/benchmarks.md session 67); elsewhere
`block_linear_reference` computes the same function in float32. Tests compare them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tokendance.kernels.fp8_block_triton import MID_ROWS, block_linear_triton
from tokendance.kernels.fp8_linear import AT_ONCE, E4M3, fast, quantize_rows, widen
from tokendance.kernels.fp8_triton import quantize_rows_triton


def quantize_groups(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] in e4m3 and its scales [M, K / k], a scale per group of k columns."""
    q, s = quantize_rows(x.reshape(-1, k))
    return q.reshape(x.shape), s.reshape(x.shape[0], -1)


def quantize_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] in e4m3 and its scales [ceil(N / bn), ceil(K / bk)], a scale per bn x bk
    block (the last ones partial, as checkpoints store them)."""
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    q, s = quantize_rows(padded.reshape(nb, bn, kb, bk).permute(0, 2, 1, 3).reshape(-1, bn * bk))
    q = q.reshape(nb, kb, bn, bk).permute(0, 2, 1, 3).reshape(nb * bn, kb * bk)
    return q[:n, :k].contiguous(), s.reshape(nb, kb)


def spread(s: torch.Tensor, bn: int, bk: int, n: int, k: int) -> torch.Tensor:
    """Block scales [..., N / bn, K / bk] as one scale per weight [..., n, k]."""
    return s.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]


def dequantize(w8: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 values (or their bytes) [..., N, K] under their blocks' scales [..., N / bn,
    K / bk], in float32. Whole blocks take their scales by broadcasting (on the CPU a
    sixth of the time `spread`'s copies took: this is each call of the reference)."""
    w, (n, k), (bn, bk) = widen(w8.view(E4M3)), w8.shape[-2:], block
    if n % bn or k % bk:  # a checkpoint's last blocks may be partial
        return w * spread(s, bn, bk, n, k)
    blocks = w.unflatten(-1, (k // bk, bk)).unflatten(-3, (n // bn, bn))  # [..., N / bn, bn, K / bk, bk]
    return (blocks * s[..., :, None, :, None]).flatten(-4, -3).flatten(-2)


def block_linear_reference(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times the e4m3 weight w8 [N, K] under block scales w_scale [N / bn, K / bk],
    x rounded per group of bk columns as the fast path rounds it; in float32, the result in
    x's dtype."""
    n, k = w8.shape
    xq, xs = quantize_groups(x.reshape(-1, k), block[1])
    out = (widen(xq) * xs.repeat_interleave(block[1], -1)) @ dequantize(w8, w_scale, block).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def block_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """`block_linear_reference`, on the GPU where `fast`: more than MID_ROWS rows through
    torch's block-scaled product where it takes them (`cublas`), else the Triton product."""
    if not fast(x):
        return block_linear_reference(x, w8, w_scale, block, bias)
    n, k = w8.shape
    rows = x.reshape(-1, k)
    out = cublas(rows, w8, w_scale, block, bias) if rows.shape[0] > MID_ROWS else None
    if out is None:
        out = block_linear_triton(*round_groups(rows, block[1]), w8, w_scale, block, bias)
    return out.reshape(*x.shape[:-1], n)


_CUBLAS: dict[int | None, str | None] = {}  # a GPU's verdict on torch's block-scaled product: None taken, else why not


def cublas(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int],
           bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] times the blocks through torch's `F.scaled_mm` (cuBLAS: input groups of 1 x
    128, weight blocks of 128 x 128, on compute capability 9.0, since torch 2.10), rows
    padded to a multiple of 4 as it needs; None where this torch or GPU does not take them
    (the first refusal is kept, `cublas_refusal`; while a CUDA graph is captured, untried is
    refused)."""
    (m, k), index = x.shape, x.device.index
    if block != (128, 128) or k // 128 % 4 or not hasattr(F, "scaled_mm"):
        return None
    if _CUBLAS.get(index) is not None or index not in _CUBLAS and torch.cuda.is_current_stream_capturing():
        return None
    xq, xs = round_groups(F.pad(x, (0, 0, 0, -m % 4)), 128)
    try:
        out = F.scaled_mm(xq, w8.t(), xs.t().contiguous().t(), F.ScalingType.BlockWise1x128, w_scale.t(),
                          F.ScalingType.BlockWise128x128, output_dtype=x.dtype)
    except (RuntimeError, NotImplementedError) as e:
        _CUBLAS[index] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return None
    _CUBLAS[index] = None
    out = out[:m]
    return out if bias is None else out + bias


def cublas_refusal(device: torch.device) -> str | None:
    """Why `cublas` does not take products on this GPU: its first refusal (None: none yet)."""
    return _CUBLAS.get(device.index)


def round_groups(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_groups` on a GPU: the rows kernel over groups of k columns."""
    rows = x.contiguous()
    xq, xs = quantize_rows_triton(rows.view(-1, k))
    return xq.view(rows.shape), xs.view(rows.shape[0], -1)


class BlockFp8Linear(nn.Module):
    """An `nn.Linear` whose weight is held in e4m3 under a float32 scale per `block` (bn
    rows x bk columns). Starts as nn.Linear starts, uniform within 1/sqrt(in_features),
    rounded: a random-weight model's; not `start`, left unwritten for a checkpoint's."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], bias: bool = False,
                 start: bool = True):
        super().__init__()
        bn, bk = block
        if out_features % bn or in_features % bk:
            raise ValueError(f"{out_features} x {in_features} is not whole blocks of {bn} x {bk}")
        self.in_features, self.out_features, self.block = in_features, out_features, (bn, bk)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=E4M3))
        self.register_buffer("scale", torch.empty(out_features // bn, in_features // bk, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if start:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        bound, bn = self.in_features ** -0.5, self.block[0]
        step = max(bn, AT_ONCE // self.in_features // bn * bn)  # float32 rows at a time, whole blocks
        for row in range(0, self.out_features, step):
            w = torch.empty(min(step, self.out_features - row), self.in_features, device=self.weight.device)
            self.put(row, *quantize_blocks(w.uniform_(-bound, bound), *self.block))
        if self.bias is not None:
            self.bias.uniform_(-bound, bound)

    def put(self, row: int, w8: torch.Tensor, scale: torch.Tensor) -> None:
        """Rows from `row` on (a whole number of blocks): e4m3 values (or their bytes) and
        their blocks' scales [rows / bn, K / bk]."""
        bn = self.block[0]
        if row % bn or w8.shape[0] % bn:
            raise ValueError(f"rows {row}..{row + w8.shape[0]} are not whole blocks of {bn}")
        self.weight.view(torch.uint8)[row:row + w8.shape[0]].copy_(w8.view(torch.uint8))
        self.scale[row // bn:(row + w8.shape[0]) // bn].copy_(scale)

    def wide(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the blocks and their scales stand for, in `dtype`."""
        return dequantize(self.weight, self.scale, self.block).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_linear(x, self.weight, self.scale, self.block, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 in {self.block} blocks"
