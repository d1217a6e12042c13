"""Low-rank K/V: a [layers, 2, tokens, heads, dim] tensor held, per layer and per K / V,
as a rank-r product u @ v (u: tokens x r, v: r x heads*dim).

KVCMAS ("Efficient KV cache Correction for Shared Context in Multi-Agent Systems")
found that the deviation of a shared segment's K/V between agents lies in few
dimensions (under rank 32 for 90 % of its energy at 7-8B) and keeps its anchors so:
r * (tokens + heads*dim) numbers per layer instead of tokens * heads*dim (at the
Qwen2.5-7B shape, 150 tokens x 512 features, 3.6x less at r = 32). Attention still reads
full K/V; only the anchors a prediction is made from are stored low-rank.

The factors come from subspace iteration (matmuls and a QR, batched over layers on any
device), not a full SVD: its u's columns are orthonormal and u @ v is the projection
of the tensor on them, within 10 % of the truncated SVD's error when the
spectrum decays (tests/backend/test_lowrank.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ITERS = 3  # power iterations: each sharpens the subspace towards the top singular vectors


@dataclass(slots=True, eq=False)
class LowRank:
    u: torch.Tensor  # [L, 2, n, r]
    v: torch.Tensor  # [L, 2, r, H*D]
    heads: int

    @property
    def shape(self) -> tuple[int, ...]:
        L, two, n, _ = self.u.shape
        return (L, two, n, self.heads, self.v.shape[-1] // self.heads)

    @property
    def nbytes(self) -> int:
        return self.u.numel() * self.u.element_size() + self.v.numel() * self.v.element_size()

    def full(self) -> torch.Tensor:
        """The [L, 2, n, H, D] tensor it stands for, in its factors' dtype."""
        return (self.u.float() @ self.v.float()).to(self.v.dtype).unflatten(-1, (self.heads, -1))


def factor(x: torch.Tensor, rank: int) -> torch.Tensor | LowRank:
    """x ([L, 2, n, H, D]) at rank `rank` per layer and K / V, in x's dtype; x itself
    where the factors would not be smaller."""
    L, two, n, H, D = x.shape
    f = H * D
    if rank <= 0 or rank * (n + f) >= n * f:
        return x
    m = x.reshape(L, two, n, f).float()
    # Start from the tokens with the largest rows: directions the tensor certainly has.
    top = m.norm(dim=-1).topk(rank, dim=-1).indices
    start = m.gather(2, top[..., None].expand(-1, -1, -1, f))  # [L, 2, r, F]
    q = torch.linalg.qr(m @ start.mT).Q  # [L, 2, n, r]
    for _ in range(ITERS):
        q = torch.linalg.qr(m @ (m.mT @ q)).Q
    return LowRank(q.to(x.dtype), (q.mT @ m).to(x.dtype), H)


def dense(t: torch.Tensor | LowRank) -> torch.Tensor:
    return t.full() if isinstance(t, LowRank) else t


def nbytes(t: torch.Tensor | LowRank | None) -> int:
    if t is None:
        return 0
    return t.nbytes if isinstance(t, LowRank) else t.numel() * t.element_size()
