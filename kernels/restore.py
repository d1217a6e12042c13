"""Move tokens' K/V between the paged pool and a packed buffer, every layer in one launch.

The pool is `KVCache.kv` [layers, 2, blocks, B, Hkv, D]: one base pointer, and a flat
slot s = block * B + offset sits at the same place in every layer's K and V. A packed
buffer is [layers, 2, n, Hkv, D]; row i of each (layer, K|V) is slot `slots[i]`.
`gather_slots` copies pool -> packed (what the host tier parks), `scatter_slots`
packed -> pool (what it restores). The packed buffer may be any strided view whose
[Hkv, D] rows are contiguous: the host tier passes a permuted [n, layers, 2, Hkv, D]
buffer, so that each parked entry is one contiguous host range (one memcpy each).

Slots must lie in the pool (0 <= s < (blocks) * B); they are checked only when they
are on the host (checking device values would sync). A slot named twice in a scatter
gets one of its rows, which one is unspecified. The kernel copies elements of any dtype as
they are; the reference moves an 8-bit pool's as bytes (`fp8.as_bytes`).
"""

from __future__ import annotations

import torch

from tokendance.kernels.fp8 import as_bytes
from tokendance.kernels.jit import HAVE_TRITON, tl, triton


def _check(kv: torch.Tensor, slots: torch.Tensor, name: str) -> None:
    if kv.dim() != 6 or kv.shape[1] != 2:
        raise ValueError(f"{name}: kv must be [layers, 2, blocks, B, Hkv, D], got {tuple(kv.shape)}")
    _, _, nb, b, h, d = kv.shape
    if (kv.stride(5), kv.stride(4), kv.stride(3), kv.stride(2)) != (1, d, h * d, b * h * d):
        raise ValueError(f"{name}: kv must be slot-major contiguous within each layer's K and V "
                         f"(strides {kv.stride()})")
    if slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError(f"{name}: slots must be a 1-d int64 tensor, got {slots.dtype} "
                         f"of shape {tuple(slots.shape)}")
    if slots.device != kv.device:
        raise ValueError(f"{name}: slots on {slots.device}, kv on {kv.device}")
    if not slots.is_cuda and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= nb * b:
            raise ValueError(f"{name}: slots must lie in [0, {nb * b}), got [{lo}, {hi}]")


def _check_packed(kv: torch.Tensor, n: int, packed: torch.Tensor, name: str) -> None:
    want = (kv.shape[0], 2, n, kv.shape[4], kv.shape[5])
    if tuple(packed.shape) != want:
        raise ValueError(f"{name}: packed must be [layers, 2, n, Hkv, D] = {want}, got {tuple(packed.shape)}")
    if packed.dtype != kv.dtype:
        raise ValueError(f"{name}: packed is {packed.dtype}, kv is {kv.dtype}")
    if packed.device != kv.device:
        raise ValueError(f"{name}: packed on {packed.device}, kv on {kv.device}")
    if packed.stride(4) != 1 or packed.stride(3) != kv.shape[5]:
        raise ValueError(f"{name}: packed rows [Hkv, D] must be contiguous (strides {packed.stride()})")


def _flat(kv: torch.Tensor) -> torch.Tensor:
    """[layers, 2, slots, Hkv, D] view of the pool."""
    return kv.view(kv.shape[0], 2, -1, kv.shape[4], kv.shape[5])


def gather_slots_reference(kv: torch.Tensor, slots: torch.Tensor,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """packed[l, c, i] = K/V (c = 0 / 1) of slot slots[i] in layer l."""
    rows = _flat(kv).index_select(2, slots)
    if out is None:
        return rows
    out.copy_(rows)
    return out


def scatter_slots_reference(kv: torch.Tensor, slots: torch.Tensor, packed: torch.Tensor) -> None:
    _flat(as_bytes(kv)).index_copy_(2, slots, as_bytes(packed))


@triton.jit
def _move_kernel(kv, packed, slots, n, s_layer, s_kv, p_layer, p_kv, p_row, W,
                 TO_PACKED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    # program (tile of slots, layer * 2 + K|V): BLOCK_T rows of W = Hkv * D elements
    lc = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rm = rows < n
    s = tl.load(slots + rows, mask=rm, other=0)
    layer, c = (lc // 2).to(tl.int64), (lc % 2).to(tl.int64)
    pool = layer * s_layer + c * s_kv + s * W
    pack = layer * p_layer + c * p_kv + rows.to(tl.int64) * p_row
    for w0 in range(0, W, BLOCK_W):
        cols = w0 + tl.arange(0, BLOCK_W)
        m = rm[:, None] & (cols < W)[None, :]
        a = kv + pool[:, None] + cols[None, :]
        b = packed + pack[:, None] + cols[None, :]
        if TO_PACKED:
            tl.store(b, tl.load(a, mask=m), mask=m)
        else:
            tl.store(a, tl.load(b, mask=m), mask=m)


def _launch(kv: torch.Tensor, slots: torch.Tensor, packed: torch.Tensor, to_packed: bool) -> None:
    n = slots.numel()
    if not n:
        return
    w = kv.shape[4] * kv.shape[5]
    bw = min(triton.next_power_of_2(w), 1024)
    bt = max(1, min(4096 // bw, triton.next_power_of_2(n)))
    grid = (triton.cdiv(n, bt), kv.shape[0] * 2)
    _move_kernel[grid](kv, packed, slots, n, kv.stride(0), kv.stride(1), packed.stride(0),
                       packed.stride(1), packed.stride(2), w,
                       TO_PACKED=to_packed, BLOCK_T=bt, BLOCK_W=bw)


def gather_slots_triton(kv: torch.Tensor, slots: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """One launch for all layers, K and V: CUDA, or CPU under TRITON_INTERPRET=1."""
    if out is None:
        out = torch.empty(kv.shape[0], 2, slots.numel(), kv.shape[4], kv.shape[5],
                          dtype=kv.dtype, device=kv.device)
    _launch(kv, slots, out, True)
    return out


def scatter_slots_triton(kv: torch.Tensor, slots: torch.Tensor, packed: torch.Tensor) -> None:
    _launch(kv, slots, packed, False)


def gather_slots(kv: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """packed [layers, 2, n, Hkv, D]: the K/V of flat slots `slots` [n] in every layer
    (into `out` when given, which may be strided). Triton on CUDA, the reference elsewhere."""
    _check(kv, slots, "gather_slots")
    if out is not None:
        _check_packed(kv, slots.numel(), out, "gather_slots")
    if kv.is_cuda and HAVE_TRITON:
        return gather_slots_triton(kv, slots, out)
    return gather_slots_reference(kv, slots, out)


def scatter_slots(kv: torch.Tensor, slots: torch.Tensor, packed: torch.Tensor) -> None:
    """Write packed [layers, 2, n, Hkv, D] into flat slots `slots` [n] of every layer."""
    _check(kv, slots, "scatter_slots")
    _check_packed(kv, slots.numel(), packed, "scatter_slots")
    if kv.is_cuda and HAVE_TRITON:
        scatter_slots_triton(kv, slots, packed)
    else:
        scatter_slots_reference(kv, slots, packed)
