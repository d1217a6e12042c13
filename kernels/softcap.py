"""Attention with capped scores, as Gemma 2 computes them: each score s = q.k * scale
becomes cap * tanh(s / cap) before the mask and the softmax (HF's attn_logit_softcapping).

torch's SDPA has no such step, so the plain-torch paths (the CPU's, and a GPU's at head
dims the Triton kernels do not tile) take `sdpa` here: SDPA where there is no cap, else the
scores written out in float32, ROWS query rows at a time so a long prompt never holds more
than ROWS x keys scores per head. The Triton kernels cap in their tile loop
(kernels/tiles.py); a GPU's fresh prompt goes to them too (kernels/prefill.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS = 256  # query rows a capped call scores at once


def cap_scores(s: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(s / cap), in place."""
    return s.div_(cap).tanh_().mul_(cap)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float = 0.0,
         mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, scale, enable_gqa)`
    with scores capped at `softcap` (0: none). q [..., Hq, n, D], k and v [..., Hkv, L, D];
    mask: bool (True: seen) or additive, broadcastable to [..., Hq, n, L]; `causal`: row i
    sees keys 0 .. i (n = L). Every row must see a key. Out in q's dtype."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=q.shape[-3] != k.shape[-3])
    g = q.shape[-3] // k.shape[-3]
    kt = k.float().repeat_interleave(g, -3).transpose(-1, -2) if g > 1 else k.float().transpose(-1, -2)
    vf = v.float().repeat_interleave(g, -3) if g > 1 else v.float()
    n, width = q.shape[-2], k.shape[-2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for a in range(0, n, ROWS):
        b = min(n, a + ROWS)
        end = b if causal else width  # causal rows see no key past their own
        s = cap_scores(torch.matmul(q[..., a:b, :].float(), kt[..., :end]).mul_(scale), softcap)
        m = mask
        if causal:
            m = torch.arange(end, device=q.device)[None, :] <= torch.arange(a, b, device=q.device)[:, None]
        elif m is not None and m.shape[-2] == n and n > 1:
            m = m[..., a:b, :]
        if m is not None:
            s = s.masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else s.add_(m)
        out[..., a:b, :] = torch.matmul(s.softmax(-1), vf[..., :end, :])
    return out
