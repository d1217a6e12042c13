"""Collective decode attention: N Mirrors reading one shared Master segment at once.

In a multi-agent round every agent ("Mirror") holds the round's shared segment (the
"Master": M tokens stored once, pre-RoPE, in pool blocks `master_table`) at its own
logical offset. Mirror s sees Master slot t (0 <= t < M) at position shift[s] + t,
unless hide[s, t] (a slot it recomputed privately). At a decode step Mirror s has one
query per head at position q_pos[s], already rotated there. Since

    (R(q_pos) q) . (R(shift + t) k) = (R(-shift) R(q_pos) q) . (R(t) k),

rotating each query by -shift[s] lets one Master-local rotation of each key serve every
Mirror: each key tile is scored against the S*G query rows of its kv head (row r =
Mirror r // G, head kvh * G + r % G) in one tl.dot. Master traffic then does not grow
with the number of Mirrors.

The result covers only the Master keys: o [S, Hq, D] and the natural-log lse [S, Hq],
both float32 (lse = -inf, o = 0 where nothing is visible); kernels/merge.py adds the
Mirror's private part (history, patches, decode tail). In the engine a batch's Master is
several segments, each at its own offset in each Mirror's prompt: `MasterRead` cuts it
into chunks inside one segment each, with a shift per (Mirror, chunk); the API above is
one segment cut into equal chunks.

The Triton kernels and their launchers are kernels/collective_triton.py's; this file
holds the definition (torch references) and the dispatch.
"""

from __future__ import annotations

import math

import torch

from tokendance.kernels.collective_triton import collective_attention_triton
from tokendance.kernels.master import MasterRead, check_segment, one_segment
from tokendance.kernels.rope import rope_rotate_reference
from tokendance.kernels.softcap import cap_scores


def collective_attention_reference(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    shift: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    master_table: torch.Tensor,
    master_len: int,
    hide: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each Mirror's query over its visible Master keys: o [S, Hq, D] and
    natural-log lse [S, Hq], float32."""
    check_segment(q, q_pos, shift, k_cache, v_cache, master_table, master_len, hide, inv_freq)
    read = one_segment(shift, master_table, master_len, hide, 1, 1)
    return master_attention_reference(q, q_pos, k_cache, v_cache, read, inv_freq, rope_scale, sm_scale)


def master_attention_reference(q, q_pos, k_cache, v_cache, read: MasterRead, inv_freq,
                               rope_scale: float, sm_scale: float, window: int = 0,
                               softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`collective_attention_reference` over a MasterRead: every Mirror gets its own
    copy of the Master keys, rotated at its positions (in a sliding window of `window`
    keys, if not 0; scores capped at `softcap`, if not 0)."""
    S, Hq, D = q.shape
    bsz, Hkv = k_cache.shape[1], k_cache.shape[2]
    chunks = read.chunks.long().cpu()
    L = int(chunks[:, 1].max()) if len(chunks) else 0
    cid = torch.full((L,), -1, dtype=torch.long)
    for c, (lo, hi, _) in enumerate(chunks.tolist()):
        cid[lo:hi] = c
    cid = cid.to(q.device)
    j = torch.arange(L, device=q.device)
    slots = read.table.long()[j // bsz] * bsz + j % bsz
    inside = (cid >= 0)[:, None, None]  # slots past a segment's end may hold anything
    k = k_cache.flatten(0, 1)[slots].float().where(inside, 0.0)  # [L, Hkv, D]
    v = v_cache.flatten(0, 1)[slots].float().where(inside, 0.0)
    pos = read.shift.long()[:, cid.clamp_min(0)] + (j - chunks[:, 2].to(q.device)[cid.clamp_min(0)])
    visible = (cid >= 0) & (read.hide[:, :L] == 0) & (pos <= q_pos.long()[:, None])
    if window:
        visible &= pos > q_pos.long()[:, None] - window
    kr = rope_rotate_reference(k.repeat(S, 1, 1), pos.where(visible, 0).flatten(), inv_freq, rope_scale)
    kr = kr.view(S, L, Hkv, D)
    qg = q.float().view(S, Hkv, Hq // Hkv, D)
    scores = torch.einsum("shgd,sthd->shgt", qg, kr) * sm_scale
    if softcap:
        scores = cap_scores(scores, softcap)
    scores = scores.masked_fill(~visible[:, None, None, :], -math.inf)
    lse = torch.logsumexp(scores, -1)  # -inf where nothing is visible
    p = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    o = torch.einsum("shgt,thd->shgd", p, v)
    return o.reshape(S, Hq, D), lse.reshape(S, Hq)


def collective_attention(q: torch.Tensor, q_pos: torch.Tensor, shift: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, master_table: torch.Tensor,
                         master_len: int, hide: torch.Tensor, inv_freq: torch.Tensor,
                         rope_scale: float, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the Triton kernels on CUDA, the reference elsewhere (the arguments are
    `collective_attention_reference`'s)."""
    args = (q, q_pos, shift, k_cache, v_cache, master_table, master_len, hide, inv_freq,
            rope_scale, sm_scale)
    if q.is_cuda:
        return collective_attention_triton(*args)
    return collective_attention_reference(*args)
