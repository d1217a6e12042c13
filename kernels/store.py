"""KV store: a step's new keys and values into the paged pool, and (optionally) its
queries rotated, in one pass.

Keys are stored un-rotated (kernels/rope.py); slot s of a layer's pool [num_blocks, B,
Hkv, D] is block s // B, offset s % B. A decode step used to launch three kernels per
layer for this (two index copies and the query rotation); on CUDA it is now one (on an
H200, Qwen2.5-7B shape, one 2.4 k-token sequence's decode step 4.91 -> 4.76 ms, ten
Mirrors' 5.60 -> 5.45 ms). The rotation is `rope_rotate`'s (kernels/rope.py's
`_rotate_token`), so greedy tokens do not change with the path.
"""

from __future__ import annotations

import torch

from tokendance.kernels.fp8 import as_bytes, is_fp8, limit, narrow
from tokendance.kernels.jit import cols, head_strides, in_heads, padded_half, tiles_head, tl, triton
from tokendance.kernels.rope import _rotate_token, rope_rotate_reference


def _check(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor) -> None:
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k and v must both be [T, {k_cache.shape[2]}, {k_cache.shape[3]}], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.shape != v_cache.shape or tuple(slots.shape) != (k.shape[0],):
        raise ValueError(f"slots {tuple(slots.shape)} must be [{k.shape[0]}] and the pools alike, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")


def store_reference(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, q: torch.Tensor | None = None,
                    pos: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                    scale: float = 1.0) -> torch.Tensor | None:
    """k, v [T, Hkv, D] into the pools at slots [T] (narrowed as `fp8.narrow` does); with
    q [T, Hq, D], returns it rotated by pos (rope_rotate's inv_freq and scale)."""
    _check(k, v, slots, k_cache, v_cache)
    h, d = k.shape[1], k.shape[2]
    for x, pool in ((k, k_cache), (v, v_cache)):
        as_bytes(pool).view(-1, h, d).index_copy_(0, slots, as_bytes(narrow(x, pool.dtype)))
    if q is None:
        return None
    return rope_rotate_reference(q, pos, inv_freq, scale)


@triton.jit
def _store_kernel(q, k, v, pos, slots, kc, vc, inv_freq, qo, s_qt, s_qh, s_kt, s_kh, s_vt, s_vh,
                  s_ot, s_oh, s_slot, s_ch, Hq, Hkv, scale,
                  HALF: tl.constexpr, HP: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_KV: tl.constexpr, ROTATE: tl.constexpr, FP8: tl.constexpr,
                  LIM: tl.constexpr):
    t = tl.program_id(0)
    d = tl.arange(0, 2 * HP)[None, :]
    hk = tl.arange(0, BLOCK_KV)[:, None]
    mk = (hk < Hkv) & cols(2 * HP, 2 * HALF, HP != HALF)[None, :]
    slot = tl.load(slots + t).to(tl.int64)
    kx = tl.load(k + in_heads(t.to(tl.int64), s_kt, HALF) + in_heads(hk, s_kh, HALF) + d, mask=mk)
    vx = tl.load(v + in_heads(t.to(tl.int64), s_vt, HALF) + in_heads(hk, s_vh, HALF) + d, mask=mk)
    if FP8:  # saturate: the store's cast then rounds to nearest even
        kx = tl.clamp(kx.to(tl.float32), -LIM, LIM)
        vx = tl.clamp(vx.to(tl.float32), -LIM, LIM)
    tl.store(kc + in_heads(slot, s_slot, HALF) + in_heads(hk, s_ch, HALF) + d, kx, mask=mk)
    tl.store(vc + in_heads(slot, s_slot, HALF) + in_heads(hk, s_ch, HALF) + d, vx, mask=mk)
    if ROTATE:
        _rotate_token(q, pos, inv_freq, qo, t, s_qt, s_qh, s_ot, s_oh, Hq, scale, HALF, HP, BLOCK_Q)


def store_triton(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, q: torch.Tensor | None = None, pos: torch.Tensor | None = None,
                 inv_freq: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor | None:
    """`store_reference` in one launch (strided q, k, v views welcome): CUDA, or CPU under
    TRITON_INTERPRET=1."""
    _check(k, v, slots, k_cache, v_cache)
    t, hkv, d = k.shape
    assert k.stride(-1) == v.stride(-1) == 1 and d % 2 == 0
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert head_strides(d, *k.stride()[:2], *v.stride()[:2], *k_cache.stride()[1:3])
    qo = None if q is None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t:
        if q is not None:
            assert q.stride(-1) == 1 and q.shape[2] == d and q.shape[0] == t
            assert head_strides(d, *q.stride()[:2])
            inv_freq = inv_freq.float().contiguous()
        # Without q the rotation's arguments are placeholders the kernel never reads.
        qs, os_ = (q, qo) if q is not None else (k, k)
        _store_kernel[(t,)](qs, k, v, slots if pos is None else pos, slots, k_cache, v_cache,
                            k if inv_freq is None else inv_freq, os_,
                            qs.stride(0), qs.stride(1), k.stride(0), k.stride(1), v.stride(0),
                            v.stride(1), os_.stride(0), os_.stride(1), k_cache.stride(1),
                            k_cache.stride(2), qs.shape[1], hkv, scale, HALF=d // 2, HP=padded_half(d),
                            BLOCK_Q=triton.next_power_of_2(qs.shape[1]),
                            BLOCK_KV=triton.next_power_of_2(hkv), ROTATE=q is not None,
                            FP8=is_fp8(k_cache.dtype), LIM=limit(k_cache.dtype))
    return qo


def store(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
          v_cache: torch.Tensor, q: torch.Tensor | None = None, pos: torch.Tensor | None = None,
          inv_freq: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor | None:
    """Dispatch: the Triton kernel on CUDA (head dims it tiles), the reference elsewhere."""
    fn = store_triton if k.is_cuda and tiles_head(k.shape[-1]) else store_reference
    return fn(k, v, slots, k_cache, v_cache, q, pos, inv_freq, scale)
