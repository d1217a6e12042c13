"""Causal attention for sequences with no earlier context in the pool.

When every sequence of a step starts at position 0, its keys and values are exactly the
ones this step computed: attention needs no paged reads and no rotation on read, and
plain causal SDPA (flash on CUDA, the fused kernel on CPU) is the fastest exact way.
Equal-length neighbours share one call; on CUDA in half precision, sequences of several
lengths share one varlen flash-attention launch instead (short segments, one call
each, left the GPU waiting on the host's launches). Same function as `paged_attention`
with kv_lens equal to the query counts (tests/kernels/test_prefill.py checks it).
"""

from __future__ import annotations

import functools

import torch

from tokendance.kernels.jit import tiles_head
from tokendance.kernels.paged_triton import paged_attention_triton
from tokendance.kernels.softcap import sdpa


# Flash attention over packed sequences (cu_seqlens), GQA included; absent from some builds.
_VARLEN = getattr(torch.ops.aten, "_flash_attention_forward", None)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int],
                     sm_scale: float, cu_dev: torch.Tensor | None = None, window: int = 0,
                     softcap: float = 0.0) -> torch.Tensor:
    """q [T, Hq, D] and k [T, Hkv, D] rotated at positions 0..n-1 of each sequence, v
    [T, Hkv, D]; sequence s is rows cu[s]..cu[s+1]-1 (cu_dev: the same offsets, int32 on
    q's device, for the varlen launch). window (0: none): a query at p sees only keys
    past p - window (flash attention's window_size_left = window - 1; elsewhere `_band`
    where a sequence is longer than the window). softcap (0: none): scores capped as
    `kernels.softcap` does; no flash kernel here caps them, so on CUDA the paged Triton
    kernel reads the step's own K/V (`capped_triton`). Returns [T, Hq, D]."""
    if softcap and q.is_cuda and tiles_head(q.shape[-1]):
        return capped_triton(q, k, v, cu, sm_scale, window, softcap)
    v = v.contiguous()  # a view into the fused qkv output
    lens = [b - a for a, b in zip(cu, cu[1:])]
    band = window and max(lens) > window
    if (cu_dev is not None and _VARLEN is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and not softcap and (band or any(n != lens[0] for n in lens))):
        n = max(lens)
        win = dict(window_size_left=window - 1, window_size_right=0) if band else {}
        return _VARLEN(q, k.to(q.dtype), v, cu_dev, cu_dev, n, n, 0.0, True, False, scale=sm_scale, **win)[0]
    out = torch.empty_like(q)
    # CPU SDPA reads [b, H, n, D] 5-8 % faster when contiguous (SmolLM2, 4 k tokens) than
    # the copies cost; CUDA's flash kernel takes the strided views.
    dense = not q.is_cuda
    s = 0
    while s < len(cu) - 1:
        n = cu[s + 1] - cu[s]
        e = s + 1
        while e < len(cu) - 1 and cu[e + 1] - cu[e] == n:
            e += 1
        lo, hi = cu[s], cu[e]

        def heads(x: torch.Tensor) -> torch.Tensor:  # [b*n, H, D] -> [b, H, n, D]
            x = x[lo:hi].unflatten(0, (e - s, n)).transpose(1, 2)
            return x.contiguous() if dense else x

        if window and n > window:
            o = _band(heads(q), heads(k).to(q.dtype), heads(v), window, sm_scale, softcap)
        else:
            o = sdpa(heads(q), heads(k).to(q.dtype), heads(v), sm_scale, softcap, causal=True)
        out[lo:hi] = o.transpose(1, 2).flatten(0, 1)
        s = e
    return out


BAND_ROWS = 256  # query rows a call in `_band`


def _band(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, sm_scale: float,
          softcap: float = 0.0) -> torch.Tensor:
    """Causal attention in a sliding window over [b, H, n, D]: rows BAND_ROWS at a time,
    each block over the keys its window reaches, masked. On 2 cores (4/1 heads of 256, a
    window of 512, medians of 5) 2,048 rows took 36 ms against 86 for one call masked
    whole, 4,096 rows 60 against 307."""
    n = q.shape[2]
    out = torch.empty_like(q)
    for a in range(0, n, BAND_ROWS):
        b = min(n, a + BAND_ROWS)
        lo = max(0, a - window + 1)
        i = torch.arange(a, b, device=q.device)[:, None]
        j = torch.arange(lo, b, device=q.device)[None, :]
        out[:, :, a:b] = sdpa(q[:, :, a:b], k[:, :, lo:b], v[:, :, lo:b], sm_scale, softcap,
                              mask=(j <= i) & (j > i - window))
    return out


def capped_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], sm_scale: float,
                  window: int, softcap: float) -> torch.Tensor:
    """`causal_attention` with capped scores by the paged prefill kernel: the step's K/V
    as a pool of one-slot blocks, each sequence's table its own rows, and no rotation on
    read (k arrives rotated: zero frequencies)."""
    pos, cu_dev, tables, lens, zero = _one_slot_tables(tuple(cu), q.shape[-1], q.device)
    kc, vc = k.to(q.dtype).contiguous()[:, None], v.to(q.dtype).contiguous()[:, None]  # [T, 1, Hkv, D]
    return paged_attention_triton(q, pos, cu_dev, kc, vc, tables, lens, zero, 1.0, sm_scale,
                                  max_q=int(tables.shape[1]), window=window, softcap=softcap)


@functools.lru_cache(maxsize=4)  # one step's layers share them
def _one_slot_tables(cu: tuple[int, ...], d: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """(positions, cu, block tables, lengths) of sequences cu[s] .. cu[s+1]-1 over one-slot
    blocks, and zero frequencies for a head of d."""
    lens = [b - a for a, b in zip(cu, cu[1:])]
    tables = (torch.tensor(cu[:-1], dtype=torch.int32)[:, None] + torch.arange(max(lens), dtype=torch.int32))
    pos = torch.cat([torch.arange(m) for m in lens])
    return (pos.to(dev), torch.tensor(cu, dtype=torch.int32, device=dev),
            tables.clamp_max(cu[-1] - 1).to(dev), torch.tensor(lens, dtype=torch.int32, device=dev),
            torch.zeros(d // 2, dtype=torch.float32, device=dev))
