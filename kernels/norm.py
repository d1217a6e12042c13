"""RMSNorm, optionally after adding the residual stream, as Llama / Qwen2 / Mistral
checkpoints define it: the row's mean square in float32, the normalized row rounded to
the input's dtype, then scaled by the weight. Gemma's (`offset`): the normalized row
scaled by 1 + weight in float32, rounded once.

The reference is the definition and the CPU path. On CUDA one Triton pass replaces the
seven to nine small kernels torch launches per norm (a decode step at batch 32 spent
about 0.7 ms of its ~11 ms in them on an H200).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokendance.kernels.jit import HAVE_TRITON, tl, triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None, offset: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x + residual) * weight, x + residual) over the last dim; with no residual,
    (norm(x) * weight, None); with `offset`, * (1 + weight). The sum is taken in x's
    dtype, as an unfused model does."""
    if residual is not None:
        x = x + residual
    # x * rsqrt(mean(x^2) + eps) in float32: torch's fused kernel gives the same bits as
    # the ops written out (tests/kernels/test_norm.py holds it to them) with fewer
    # temporaries; with the SwiGLU change beside it, a 4 k bf16 CPU prefill 7.52 -> 7.07 s.
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if offset:
        return (normed * (1.0 + weight.float())).to(x.dtype), x if residual is not None else None
    return weight * normed.to(x.dtype), x if residual is not None else None


@triton.jit
def _rms_kernel(x, res, w, y, r_out, n, eps, s_x, s_r, s_y, s_ro,
                HAS_RES: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    h = tl.load(x + row * s_x + offs, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(res + row * s_r + offs, mask=m, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype, fp_downcast_rounding="rtne")
        tl.store(r_out + row * s_ro + offs, h, mask=m)
    hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n + eps)
    wt = tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
    if OFFSET:
        out = (hf * inv * (1.0 + wt)).to(y.dtype.element_ty, fp_downcast_rounding="rtne")
    else:
        normed = (hf * inv).to(h.dtype, fp_downcast_rounding="rtne").to(tl.float32)
        out = (wt * normed).to(y.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(y + row * s_y + offs, out, mask=m)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None, offset: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pass per row of x [T, n] (rows may be strided): CUDA, or CPU under
    TRITON_INTERPRET=1."""
    t, n = x.shape
    assert x.stride(-1) == 1 and weight.is_contiguous()
    y = torch.empty(t, n, dtype=x.dtype if offset else torch.promote_types(x.dtype, weight.dtype), device=x.device)
    r_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        r_out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t:
        res = residual if residual is not None else x
        ro = r_out if r_out is not None else y
        block = triton.next_power_of_2(n)
        _rms_kernel[(t,)](x, res, weight, y, ro, n, eps, x.stride(0), res.stride(0), y.stride(0),
                          ro.stride(0), HAS_RES=residual is not None, OFFSET=offset, BLOCK=block,
                          num_warps=min(16, max(1, block // 512)))
    return y, r_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, offset: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere."""
    if x.is_cuda and HAVE_TRITON and x.dim() == 2:
        return rms_norm_triton(x, weight, eps, residual, offset)
    return rms_norm_reference(x, weight, eps, residual, offset)
