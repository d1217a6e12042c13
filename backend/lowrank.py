"""Low-rank K/V: a [layers, 2, tokens, heads, dim] tensor held, per layer and per K / V,
as a rank-r product u @ v (u: tokens x r, v: r x heads*dim).

KVCMAS ("Efficient KV cache Correction for Shared Context in Multi-Agent Systems")
found that the deviation of a shared segment's K/V between agents lies in few
dimensions (under rank 32 for 90 % of its energy at 7-8B) and keeps its anchors so:
r * (tokens + heads*dim) numbers per layer instead of tokens * heads*dim (at the
Qwen2.5-7B shape, 150 tokens x 512 features, 3.6x less at r = 32). Attention still reads
full K/V; only the anchors a prediction is made from are stored low-rank.

The factors come from subspace iteration (matmuls and Cholesky QR, batched over layers
and anchors on any device), not a full SVD: u's columns are orthonormal, u @ v is the
projection of the tensor on them, within 10 % of the truncated SVD's error when the
spectrum decays (tests/backend/test_lowrank.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ITERS = 3  # power iterations: each sharpens the subspace towards the top singular vectors
CHUNK = 256 << 20  # float32 bytes of one batched factoring


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
    """x ([L, 2, n, H, D]) at `rank` per layer and K / V, in x's dtype; x itself where
    the factors would not be smaller."""
    return factor_all([x], rank)[0]


def factor_all(xs: list[torch.Tensor], rank: int, chunk: int = CHUNK) -> list[torch.Tensor | LowRank]:
    """Each of xs as `factor` gives it, in batched calls: a step's anchors (hundreds at
    N = 20) are factored in a few launches, not a few per anchor. A batch pads its
    tensors with zero tokens to its longest (a zero row adds nothing to the subspace and
    gets a zero row of u); `chunk` bounds a batch's float32 bytes."""
    out: list[torch.Tensor | LowRank] = list(xs)
    todo = [i for i, x in enumerate(xs) if _saves(x, rank)]
    while todo:
        L, two, _, H, D = xs[todo[0]].shape
        take, width = [], 0
        for i in todo:
            w = max(width, xs[i].shape[2])
            if take and (len(take) + 1) * L * two * w * H * D * 4 > chunk:
                break
            take.append(i)
            width = w
        todo = todo[len(take):]
        m = torch.stack([torch.nn.functional.pad(xs[i].reshape(L, two, -1, H * D).float(),
                                                 (0, 0, 0, width - xs[i].shape[2])) for i in take])
        q = _basis(m, rank)
        v = q.mT @ m
        for g, i in enumerate(take):
            dt = xs[i].dtype
            out[i] = LowRank(q[g, :, :, :xs[i].shape[2]].to(dt), v[g].to(dt), H)
    return out


def _saves(x: torch.Tensor, rank: int) -> bool:
    n, f = x.shape[2], x.shape[3] * x.shape[4]
    return 0 < rank and rank * (n + f) < n * f


def _basis(m: torch.Tensor, rank: int) -> torch.Tensor:
    """[..., n, F] -> [..., n, rank]: orthonormal columns spanning m's leading left
    singular vectors, by subspace iteration started from m's largest rows."""
    top = m.norm(dim=-1).topk(rank, dim=-1).indices
    q = _orthonormal(m @ m.gather(-2, top[..., None].expand(*top.shape, m.shape[-1])).mT)
    for _ in range(ITERS):
        q = _orthonormal(m @ (m.mT @ q))
    return q


def _orthonormal(y: torch.Tensor) -> torch.Tensor:
    """y's columns made orthonormal by Cholesky QR, twice (the second pass restores what
    the first lost to rounding): r x r Cholesky factors and triangular solves, batched on
    any device, where a Householder QR of each tall matrix is a launch of its own on
    CUDA. A column y lacks (an all-zero anchor, fewer tokens than the rank) comes out
    zero, held off by a small ridge."""
    eye = torch.eye(y.shape[-1], device=y.device, dtype=y.dtype)
    for _ in range(2):
        g = y.mT @ y
        ridge = 1e-6 * g.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] + 1e-30
        low, _ = torch.linalg.cholesky_ex(g + ridge * eye)
        y = torch.linalg.solve_triangular(low, y.mT, upper=False).mT
    return y


def dense(t: torch.Tensor | LowRank) -> torch.Tensor:
    return t.full() if isinstance(t, LowRank) else t


def nbytes(t: torch.Tensor | LowRank | None) -> int:
    if t is None:
        return 0
    return t.nbytes if isinstance(t, LowRank) else t.numel() * t.element_size()
