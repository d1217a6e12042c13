"""SwiGLU's activation: silu(gate) * up over the fused gate_up projection's output (and
GeGLU's, Gemma's, with tanh-approximated gelu in silu's place: torch's two ops).

The reference is the definition and the CPU path: torch's two ops, silu rounded to the
input's dtype, then the product. On CUDA one Triton pass reads both halves once and
writes the product; the two ops make five passes over [T, I] between them (on an
H200, `aten::silu` alone took 30 ms of a 10 x 2 k-token round's 431 ms of GPU time; at
4 k x 18,944 bf16 the fused pass takes 0.141 ms against 0.462, with equal outputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokendance.kernels.jit import HAVE_TRITON, tl, triton

BLOCK = 1024


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate, then up) -> silu(gate) * up [..., I]."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate).mul_(up)  # into silu's output: one [T, I] buffer, not two


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate, then up) -> gelu_tanh(gate) * up [..., I], as HF's
    gelu_pytorch_tanh then the product, each rounded to x's dtype."""
    gate, up = x.chunk(2, -1)
    return F.gelu(gate, approximate="tanh").mul_(up)


@triton.jit
def _silu_mul_kernel(x, y, n, s_x, s_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = col < n
    g = tl.load(x + row * s_x + col, mask=m, other=0.0)
    u = tl.load(x + row * s_x + n + col, mask=m, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype, fp_downcast_rounding="rtne")  # as F.silu rounds
    out = (a.to(tl.float32) * u.to(tl.float32)).to(y.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(y + row * s_y + col, out, mask=m)


def silu_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """One pass over x [T, 2I] (rows may be strided): CUDA, or CPU under TRITON_INTERPRET=1."""
    t, n2 = x.shape
    assert x.stride(-1) == 1 and n2 % 2 == 0
    n = n2 // 2
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(n, BLOCK))](x, y, n, x.stride(0), y.stride(0), BLOCK=BLOCK,
                                                      num_warps=4)
    return y


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA in half precision (bit-equal to the two ops
    there, measured), the reference elsewhere: float32 stays our exact reference."""
    if x.is_cuda and HAVE_TRITON and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16):
        return silu_mul_triton(x)
    return silu_mul_reference(x)
