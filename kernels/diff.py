"""Diff encode: how far a sequence's K/V sit from the Master's copy, token by token.

For pairs of flat pool slots (a token in a sequence's own blocks, the same token's base
in the Master's), the largest |a - b| over K and V, every head and channel, reduced
over two ranges of layers: before `split` and from it on. These are a Mirror's two
views (backend/mirror.py): a token whose early layers equal the Master's can read them
there, one whose late layers differ needs a private patch. Token-granular rather than
block-granular, as Mirrors are (a 16-token block holding one differing token would
otherwise stay private whole). Both functions read the pool tensor in place:
`kv` [layers, 2, blocks, block size, kv heads, head dim], contiguous, its values (8-bit
floats too: kernels/fp8.py) cast up to float32, which holds them exactly.
"""

from __future__ import annotations

import torch

from tokendance.kernels.jit import HAVE_TRITON, tl, triton


def kv_diff_reference(kv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [T] long slots; returns (early, late) [T] float32: max |a - b| over layers
    [0, split) and [split, layers) (0 for an empty range)."""
    flat = kv.flatten(2, 3)  # [layers, 2, slots, heads, dim]
    per_layer = torch.stack([
        (flat[layer, :, a].float() - flat[layer, :, b].float()).abs().amax(dim=(0, 2, 3))
        if len(a) else torch.zeros(0, device=kv.device)
        for layer in range(kv.shape[0])])  # [layers, T]
    zero = torch.zeros(len(a), dtype=torch.float32, device=kv.device)
    early = per_layer[:split].amax(0) if split > 0 else zero
    late = per_layer[split:].amax(0) if split < kv.shape[0] else zero
    return early, late


@triton.jit
def _diff_kernel(kv, a, b, early, late, layers, split, layer_stride, half_stride, width,
                 BLOCK: tl.constexpr):
    t = tl.program_id(0)
    sa = tl.load(a + t).to(tl.int64) * width
    sb = tl.load(b + t).to(tl.int64) * width
    lo = tl.zeros([BLOCK], dtype=tl.float32)
    hi = tl.zeros([BLOCK], dtype=tl.float32)
    k = kv  # layer 0's K; pointers advance, so no index product overflows int32
    for layer in range(0, layers):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, width, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < width
            for half in range(0, 2):  # K, then V
                x = tl.load(k + half * half_stride + sa + offs, mask=m, other=0.0).to(tl.float32)
                y = tl.load(k + half * half_stride + sb + offs, mask=m, other=0.0).to(tl.float32)
                acc = tl.maximum(acc, tl.abs(x - y))
        if layer < split:
            lo = tl.maximum(lo, acc)
        else:
            hi = tl.maximum(hi, acc)
        k += layer_stride
    tl.store(early + t, tl.max(lo, 0))
    tl.store(late + t, tl.max(hi, 0))


def kv_diff_triton(kv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton launcher: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1. One
    program per token pair, looping over the layers: the reduction over layers stays in
    registers and nothing is written but two floats per token."""
    assert kv.is_contiguous(), "the pool tensor is read in place"
    t = len(a)
    early = torch.empty(t, dtype=torch.float32, device=kv.device)
    late = torch.empty(t, dtype=torch.float32, device=kv.device)
    if t:
        layers, _, blocks, size = kv.shape[:4]
        width = kv.shape[4] * kv.shape[5]
        half = blocks * size * width
        _diff_kernel[(t,)](kv, a.to(kv.device), b.to(kv.device), early, late, layers, split,
                           2 * half, half, width, BLOCK=min(1024, triton.next_power_of_2(width)))
    return early, late


def kv_diff(kv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere."""
    if kv.is_cuda and HAVE_TRITON:
        return kv_diff_triton(kv, a, b, split)
    return kv_diff_reference(kv, a.to(kv.device), b.to(kv.device), split)
