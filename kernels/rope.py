"""Rotary position embedding, applied on read.

Keys live in the KV pool un-rotated; attention rotates them from each token's logical
position, so one stored block can serve any sequence at any offset. The convention is
the "rotate half" one of Llama / Qwen2 / Mistral checkpoints: the head dimension is
split in two halves (x1, x2) that rotate as the real and imaginary parts of D/2
complex numbers.
"""

from __future__ import annotations

import torch

from tokendance.kernels.jit import cols, head_strides, in_heads, padded_half, tiles_head, tl, triton

# (inv_freq storage, layout, scale) -> (cos, sin, inv_freq) tables over positions
# 0..n-1. Every layer of every step rotates by the same positions: compute cos/sin once,
# then gather. An entry keeps its inv_freq alive, so no other tensor can take over that
# address while the entry exists (inv_freq must not be changed in place).
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_MAX_TABLES = 16


def _table(inv_freq: torch.Tensor, scale: float, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (inv_freq.data_ptr(), str(inv_freq.device), inv_freq.dtype, inv_freq.shape,
           inv_freq.stride(), scale)
    cached = _TABLES.get(key)
    if cached is None or cached[0].shape[0] < n:
        size = max(n, 2 * cached[0].shape[0] if cached else 4096)
        pos = torch.arange(size, device=inv_freq.device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.to(torch.float32)[None, :]
        cached = (freqs.cos() * scale, freqs.sin() * scale, inv_freq)
        _TABLES.pop(key, None)
        while len(_TABLES) >= _MAX_TABLES:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = cached
    return cached[0], cached[1]


def rope_cos_sin(
    pos: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [len(pos), D/2], in float32 (exactly cos/sin(pos * inv_freq) * scale)."""
    if pos.is_cuda or pos.numel() == 0:
        # On a GPU cos/sin are cheap, and a table would need the largest position on
        # the host: a device sync per call.
        freqs = pos.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
        return freqs.cos() * scale, freqs.sin() * scale
    cos, sin = _table(inv_freq, scale, int(pos.max()) + 1)
    idx = pos.to(device=cos.device, dtype=torch.long)
    return cos[idx], sin[idx]


def rope_rotate_reference(
    x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0,
    inplace: bool = False,
) -> torch.Tensor:
    """Rotate x [T, H, D] by positions pos [T]; math in float32, result in x.dtype. With
    `inplace`, a float32 x (a fresh gather the caller owns) is rotated where it is."""
    cos, sin = rope_cos_sin(pos, inv_freq, scale)
    return rope_apply(x, cos[:, None, :], sin[:, None, :], inplace=inplace)


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """Rotate x [..., D] by cos, sin (rope_cos_sin's, shaped to broadcast against x's
    halves [..., D/2]); math in float32, result in x.dtype; `inplace` as in
    rope_rotate_reference."""
    half = x.shape[-1] // 2
    out = x if inplace and x.dtype == torch.float32 else x.to(torch.float32, copy=True)
    x1, x2 = out[..., :half], out[..., half:]
    keep = x1.clone()
    x1.mul_(cos).addcmul_(x2, sin, value=-1)
    x2.mul_(cos).addcmul_(keep, sin)
    return out.to(x.dtype)


@triton.jit
def _rotate_token(x, pos, inv_freq, out, t, sxt, sxh, sot, soh, H, scale,
                  HALF: tl.constexpr, HP: tl.constexpr, BLOCK_H: tl.constexpr):
    """Token t's H heads of x rotated by pos[t] into out, in float32 (kernels/store.py
    rotates queries with it too). HP: HALF's columns, padded to a power of two."""
    d = tl.arange(0, HP)
    h = tl.arange(0, BLOCK_H)[:, None]
    dm = cols(HP, HALF, HP != HALF)
    ang = tl.load(pos + t).to(tl.float32) * tl.load(inv_freq + d, mask=dm, other=0.0).to(tl.float32)
    c = (tl.cos(ang) * scale)[None, :]
    s = (tl.sin(ang) * scale)[None, :]
    m = (h < H) & dm[None, :]
    src = x + in_heads(t.to(tl.int64), sxt, HALF) + in_heads(h, sxh, HALF) + d[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    dst = out + in_heads(t.to(tl.int64), sot, HALF) + in_heads(h, soh, HALF) + d[None, :]
    tl.store(dst, (x1 * c - x2 * s).to(out.dtype.element_ty), mask=m)
    tl.store(dst + HALF, (x2 * c + x1 * s).to(out.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(x, pos, inv_freq, out, sxt, sxh, sot, soh, H, scale,
                 HALF: tl.constexpr, HP: tl.constexpr, BLOCK_H: tl.constexpr):
    _rotate_token(x, pos, inv_freq, out, tl.program_id(0), sxt, sxh, sot, soh, H, scale, HALF, HP,
                  BLOCK_H)


def rope_rotate_triton(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor,
                       scale: float = 1.0) -> torch.Tensor:
    """One pass over x (strided views welcome): CUDA, or CPU under TRITON_INTERPRET=1."""
    t, h, d = x.shape
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    if t:
        assert x.stride(-1) == 1 and d % 2 == 0 and head_strides(d, *x.stride()[:2], *out.stride()[:2])
        _rope_kernel[(t,)](x, pos, inv_freq.float().contiguous(), out, x.stride(0), x.stride(1),
                           out.stride(0), out.stride(1), h, scale,
                           HALF=d // 2, HP=padded_half(d), BLOCK_H=triton.next_power_of_2(h))
    return out


def rope_rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor,
                scale: float = 1.0) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA (one pass instead of ten; head dims it tiles),
    the reference elsewhere."""
    if x.is_cuda and tiles_head(x.shape[-1]):
        return rope_rotate_triton(x, pos, inv_freq, scale)
    return rope_rotate_reference(x, pos, inv_freq, scale)
