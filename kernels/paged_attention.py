"""Paged attention with RoPE on read.

One function, two implementations: `paged_attention_reference` in plain torch (the
definition, and the CPU path) and a Triton kernel (the CUDA path). Both read keys
stored *before* RoPE from a paged pool and rotate each key by its logical position
while reading it.

Layout of one layer's pool: k_cache, v_cache [num_blocks, B, Hkv, D]. Sequence s owns
logical key slots 0 .. kv_lens[s]-1; slot j lives in physical block
block_tables[s, j // B] at offset j % B, and its logical position is j. Queries of
sequence s are rows cu_q[s] .. cu_q[s+1]-1 of q, already rotated at q_pos; a query at
position p attends to the keys at positions <= p (prefill, chunked prefill and decode
are the same call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokendance.kernels.rope import rope_rotate


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, kv_len: int
) -> torch.Tensor:
    """The first kv_len slots of one sequence, [kv_len, Hkv, D]."""
    bsz = cache.shape[1]
    nblocks = (kv_len + bsz - 1) // bsz
    blocks = cache.index_select(0, block_table[:nblocks].long())
    return blocks.flatten(0, 1)[:kv_len]


def paged_attention_reference(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    sm_scale: float,
) -> torch.Tensor:
    """Attention output [T, Hq, D] in q.dtype."""
    out = torch.empty_like(q)
    starts = cu_q.tolist()
    lens = kv_lens.tolist()
    for s, kv_len in enumerate(lens):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        k = gather_kv(k_cache, block_tables[s], kv_len)
        v = gather_kv(v_cache, block_tables[s], kv_len)
        kpos = torch.arange(kv_len, device=q.device)
        k = rope_rotate(k, kpos, inv_freq, rope_scale)
        qs = q[lo:hi]
        mask = None
        qp = q_pos[lo:hi]
        # Decode (one query at the last slot) and plain prefill need no explicit mask.
        if not (hi - lo == 1 and int(qp[0]) >= kv_len - 1):
            mask = kpos[None, :] <= qp[:, None].to(kpos.dtype)
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1),
            k.transpose(0, 1).to(qs.dtype),
            v.transpose(0, 1),
            attn_mask=mask,
            scale=sm_scale,
            enable_gqa=True,
        )
        out[lo:hi] = o.transpose(0, 1)
    return out


def paged_attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    sm_scale: float,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere."""
    if q.is_cuda:
        from tokendance.kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(
            q, q_pos, cu_q, k_cache, v_cache, block_tables, kv_lens,
            inv_freq, rope_scale, sm_scale,
        )
    return paged_attention_reference(
        q, q_pos, cu_q, k_cache, v_cache, block_tables, kv_lens,
        inv_freq, rope_scale, sm_scale,
    )
