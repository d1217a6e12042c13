"""Linear layers with 8-bit float weights (vLLM's `--quantization fp8` of an unquantized
checkpoint): each weight row rounded to e4m3 at load under a scale of its own (its largest
magnitude maps to e4m3's 448), each input row the same way per call (dynamic, per token);
the product accumulates in float32 and takes both scales on the way out. Half a bf16
weight's bytes: what a decode step reads most of, and room for more KV.

On a GPU with FP8 tensor cores (compute capability 9.0 on, bf16 activations) the rows are
rounded in one Triton launch, and the product is a Triton kernel that streams the weight
for a few rows (a decode step's) or one `torch._scaled_mm` with row-wise scales for more
(kernels/fp8_triton.py). Elsewhere `fp8_linear_reference` computes the same function in
float32 (the weight widened on each call: memory saved, not time). Tests compare them.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from tokendance.kernels.fp8 import narrow
from tokendance.kernels.fp8_triton import E4M3, INV_TOP, TINY, few_rows_triton, quantize_rows_triton
from tokendance.kernels.jit import HAVE_TRITON

FEW_ROWS = 16  # at most this many rows take few_rows_triton, more torch._scaled_mm


def quantize_rows(x: torch.Tensor, fixed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in e4m3, float32 scales [rows, 1]) with x ~ q * scale, row by row; every row under
    `fixed` (a scalar: a checkpoint's static input scale) where given, saturating."""
    x = x.float()
    if fixed is None:
        scale = x.abs().amax(-1, keepdim=True).clamp_min(TINY) * INV_TOP
    else:
        scale = fixed.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return narrow(x / scale, E4M3), scale


# Every e4m3 byte's value: on the CPU a weight widens by looking its bytes up, SmolLM2's
# gate_up (3,072 x 576) in 1.19 ms through int32 indices, where int64 ones (torch.take)
# took 1.65 and `.float()` 3.8 (2-core AMD EPYC)
WIDE = torch.arange(256, dtype=torch.uint8).view(E4M3).float()


def widen(w8: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor in float32."""
    if w8.is_cuda:
        return w8.float()
    return WIDE.index_select(0, w8.view(torch.uint8).flatten().int()).view(w8.shape)


def fp8_linear_reference(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None = None, x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times the e4m3 weight w8 [N, K] (scales [N, 1]) in float32, x quantized
    per row as the fast path does (under `x_scale`, a static input scale, where given),
    both scales taken by the product's rows and columns as the fast path takes them; the
    result in x's dtype."""
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]), x_scale)
    out = (widen(xq) @ widen(w8).t()) * xs * w_scale.view(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], w8.shape[0])


def fast(x: torch.Tensor) -> bool:
    """Whether the FP8 tensor cores take x's product: a bf16 input on a GPU of compute
    capability 9.0 or more (`torch._scaled_mm`'s row-wise scales need it)."""
    return HAVE_TRITON and x.is_cuda and x.dtype == torch.bfloat16 and _capability(x.device.index) >= (9, 0)


@cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_linear_reference`, on FP8 tensor cores where `fast`."""
    if not fast(x):
        return fp8_linear_reference(x, w8, w_scale, bias, x_scale)
    xq, xs = quantize_rows_triton(x.reshape(-1, x.shape[-1]).contiguous(), x_scale)
    if xq.shape[0] <= FEW_ROWS:
        out = few_rows_triton(xq, xs, w8, w_scale, bias)
    else:
        out = torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16)
        if bias is not None:
            out = out + bias
    return out.reshape(*x.shape[:-1], w8.shape[0])


class Fp8Linear(nn.Module):
    """An `nn.Linear` whose weight is held in e4m3 with a float32 scale per output row (and,
    `static`, its input rounded under one scale a checkpoint gives, not per row). Starts as
    nn.Linear starts, uniform within 1/sqrt(in_features), rounded: a random-weight model's;
    not `start`, its rows are left unwritten for a checkpoint's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, static: bool = False,
                 start: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=E4M3))
        self.register_buffer("scale", torch.empty(out_features, 1, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32) if static else None)
        if start:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        bound = self.in_features ** -0.5
        step = max(1, AT_ONCE // self.in_features)  # float32 rows at a time, not the whole weight
        for row in range(0, self.out_features, step):
            w = torch.empty(min(step, self.out_features - row), self.in_features, device=self.weight.device)
            self.put(row, *quantize_rows(w.uniform_(-bound, bound)))
        if self.bias is not None:
            self.bias.uniform_(-bound, bound)

    def put(self, row: int, w8: torch.Tensor, scale: torch.Tensor) -> None:
        """Rows from `row` on: e4m3 values (or their bytes) and their scales [rows, 1]."""
        self.weight.view(torch.uint8)[row:row + w8.shape[0]].copy_(w8.view(torch.uint8))
        self.scale[row:row + w8.shape[0]].copy_(scale)

    @classmethod
    @torch.no_grad()
    def of(cls, linear: nn.Linear) -> "Fp8Linear":
        """`linear`'s weight rounded, row by row, on its device."""
        w = linear.weight.detach()
        with torch.device(w.device):
            f = cls(linear.in_features, linear.out_features, linear.bias is not None, start=False)
        f.put(0, *quantize_rows(w))
        f.bias = linear.bias
        return f

    def wide(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the rows and their scales stand for, in `dtype`."""
        return (widen(self.weight) * self.scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.scale, self.bias, self.input_scale)

    def extra_repr(self) -> str:
        static = ", static input scale" if self.input_scale is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3{static}"


AT_ONCE = 1 << 24  # values a random start draws in float32 at once (64 MiB)
QUANTIZED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # a layer's projections


def fits(in_features: int, out_features: int) -> bool:
    """Whether a projection can be held in e4m3: both widths divide by 16 (`torch._scaled_mm`'s tiles)."""
    return in_features % 16 == 0 and out_features % 16 == 0


@torch.no_grad()
def quantize(model: nn.Module) -> int:
    """Replace each layer's projections (attention's and the dense MLP's, a shared expert's
    too; not the embeddings, the lm_head, a router or the experts' grouped weights) by
    Fp8Linear where it `fits`; returns how many were replaced. (The engine builds them so
    from the start: backend/quant.py.)"""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if name in QUANTIZED and isinstance(child, nn.Linear) and fits(child.in_features, child.out_features)]
    for parent, name, child in swaps:
        setattr(parent, name, Fp8Linear.of(child))
    return len(swaps)
