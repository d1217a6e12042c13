"""Attention over the union of two disjoint key sets, from each set's partial result:
how a Mirror's private part and its Master part (kernels/collective.py), and the CPU
path's runs (kernels/runs.py), are put together."""

from __future__ import annotations

import torch


def merge_attention(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from the two partial results
    (o [..., D], natural-log lse [...]); a side with lse = -inf contributes nothing."""
    if o1.shape != o2.shape or lse1.shape != lse2.shape or o1.shape[:-1] != lse1.shape:
        raise ValueError(f"cannot merge o {tuple(o1.shape)}/{tuple(o2.shape)} with lse "
                         f"{tuple(lse1.shape)}/{tuple(lse2.shape)}")
    lse = torch.logaddexp(lse1, lse2)
    base = lse.nan_to_num(neginf=0.0)  # both sides empty: weights exp(-inf) = 0
    w1 = torch.exp(lse1 - base)[..., None]
    w2 = torch.exp(lse2 - base)[..., None]
    return o1 * w1 + o2 * w2, lse
