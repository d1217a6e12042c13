"""KV deviation at the check layer, and the per-request top-k of deviating tokens.

`kv_deviation` scores each token by how far its freshly computed K/V sit from the
reused ones: the squared L2 distance summed over heads, for K and V, relative to the
squared norm of the fresh values (so tokens with large activations do not dominate).
`select_top` picks, per request, the ceil(ratio * n) reused tokens that deviate most,
for all requests at once (one sort over a padded [N, max_len] matrix); with a `floor`,
only those of them whose deviation exceeds it (recompute what deviates, at most r %).
`select_top_padded` leaves them on the device for one read-back by the caller.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tokendance.kernels.jit import HAVE_TRITON, tl, triton


def kv_deviation_parts_reference(k_new: torch.Tensor, v_new: torch.Tensor,
                                 k_old: torch.Tensor, v_old: torch.Tensor) -> torch.Tensor:
    """Inputs [T, H, D] (the old ones maybe an 8-bit pool's: all is read in float32);
    returns [T, 4] float32: the squared distance of K, K's squared norm, the same of V
    (sums over heads: a tensor-parallel rank's add up to the whole's)."""
    kn, vn = k_new.float().flatten(1), v_new.float().flatten(1)
    dk = (kn - k_old.float().flatten(1)).pow(2).sum(-1)
    dv = (vn - v_old.float().flatten(1)).pow(2).sum(-1)
    return torch.stack([dk, kn.pow(2).sum(-1), dv, vn.pow(2).sum(-1)], 1)


def combine(parts: torch.Tensor) -> torch.Tensor:
    """[T, 4] parts -> [T] deviation."""
    return parts[:, 0] / parts[:, 1].clamp_min(1e-12) + parts[:, 2] / parts[:, 3].clamp_min(1e-12)


def kv_deviation_reference(k_new: torch.Tensor, v_new: torch.Tensor,
                           k_old: torch.Tensor, v_old: torch.Tensor) -> torch.Tensor:
    """Inputs [T, H, D]; returns [T] float32."""
    return combine(kv_deviation_parts_reference(k_new, v_new, k_old, v_old))


@triton.jit
def _deviation_kernel(kn, vn, ko, vo, out, width, BLOCK: tl.constexpr, PARTS: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * width
    dk = tl.zeros([BLOCK], dtype=tl.float32)
    nk = tl.zeros([BLOCK], dtype=tl.float32)
    dv = tl.zeros([BLOCK], dtype=tl.float32)
    nv = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < width
        a = tl.load(kn + base + offs, mask=m, other=0.0).to(tl.float32)
        b = tl.load(ko + base + offs, mask=m, other=0.0).to(tl.float32)
        c = tl.load(vn + base + offs, mask=m, other=0.0).to(tl.float32)
        d = tl.load(vo + base + offs, mask=m, other=0.0).to(tl.float32)
        dk += (a - b) * (a - b)
        nk += a * a
        dv += (c - d) * (c - d)
        nv += c * c
    if PARTS:
        tl.store(out + row * 4, tl.sum(dk, 0))
        tl.store(out + row * 4 + 1, tl.sum(nk, 0))
        tl.store(out + row * 4 + 2, tl.sum(dv, 0))
        tl.store(out + row * 4 + 3, tl.sum(nv, 0))
    else:
        acc = tl.sum(dk, 0) / tl.maximum(tl.sum(nk, 0), 1e-12) + tl.sum(dv, 0) / tl.maximum(tl.sum(nv, 0), 1e-12)
        tl.store(out + row, acc)


def kv_deviation_triton(k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor,
                        v_old: torch.Tensor, parts: bool = False) -> torch.Tensor:
    """The Triton launcher: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1. [T], or
    with `parts` the [T, 4] sums the deviation is made of."""
    t = k_new.shape[0]
    width = k_new[0].numel()
    out = torch.empty((t, 4) if parts else (t,), dtype=torch.float32, device=k_new.device)
    args = [x.contiguous() for x in (k_new, v_new, k_old, v_old)]
    _deviation_kernel[(t,)](*args, out, width, BLOCK=min(1024, triton.next_power_of_2(width)), PARTS=parts)
    return out


def kv_deviation(k_new: torch.Tensor, v_new: torch.Tensor, k_old: torch.Tensor, v_old: torch.Tensor,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere. `reduce`: sums a
    tensor over the tensor-parallel ranks, each of which holds some of the heads (the
    deviation is then the whole model's, the same on every rank)."""
    fast = k_new.is_cuda and HAVE_TRITON and k_new.shape[0]
    if reduce is None:
        if fast:
            return kv_deviation_triton(k_new, v_new, k_old, v_old)
        return kv_deviation_reference(k_new, v_new, k_old, v_old)
    parts = (kv_deviation_triton(k_new, v_new, k_old, v_old, parts=True) if fast
             else kv_deviation_parts_reference(k_new, v_new, k_old, v_old))
    return combine(reduce(parts))


def select_top_reference(dev: torch.Tensor, groups: list[torch.Tensor], ratio: float,
                         floor: float = 0.0) -> list[torch.Tensor]:
    """For each group (indices into dev), the ceil(ratio * len) indices with the largest
    deviation, less those whose deviation is at most `floor` (if floor > 0)."""
    out = []
    for idx in groups:
        k = math.ceil(ratio * len(idx))
        top = idx[dev[idx].topk(k).indices] if k else idx[:0]
        if floor > 0:
            top = top[dev[top] > floor]
        out.append(top.sort().values)
    return out


def caps(sizes: list[int], ratio: float) -> list[int]:
    """How many of each group `select_top` picks without a floor: ceil(ratio * size),
    in Python floats (the device computes the same double-precision product)."""
    return [math.ceil(ratio * n) for n in sizes]


def select_top_padded(dev: torch.Tensor, groups: list[torch.Tensor], ratio: float,
                      floor: float = 0.0) -> torch.Tensor:
    """`select_top_reference`'s picks for all groups at once, as one [len(groups), k]
    long tensor on dev's device: row i holds group i's picks ascending, then -1s. One
    sort over a padded [N, max_len] matrix, and nothing the host waits for: the caller
    reads the picks back in one copy, when it needs them."""
    n = len(groups)
    k = max(caps([len(g) for g in groups], ratio), default=0)
    if k == 0:
        return torch.full((n, 0), -1, dtype=torch.long, device=dev.device)
    width = max(len(g) for g in groups)
    idx = torch.full((n, width), -1, dtype=torch.long, device=dev.device)
    for i, g in enumerate(groups):
        idx[i, : len(g)] = g
    vals = torch.where(idx >= 0, dev[idx.clamp_min(0)], torch.full_like(idx, float("-inf"), dtype=dev.dtype))
    top = vals.sort(dim=1, descending=True, stable=True)
    # The cap of each row, from the same double-precision product as the reference.
    cap = torch.ceil((idx >= 0).sum(1, keepdim=True).double() * ratio).long()
    keep = torch.arange(k, device=dev.device) < cap
    if floor > 0:
        keep &= top.values[:, :k] > floor
    big = torch.iinfo(torch.long).max
    chosen = torch.where(keep, idx.gather(1, top.indices[:, :k]), big).sort(dim=1).values
    return torch.where(chosen == big, -1, chosen)


def unpad(picks: torch.Tensor) -> list[torch.Tensor]:
    """The rows of `select_top_padded` without their -1s."""
    return [row[row >= 0] for row in picks]


def select_top(dev: torch.Tensor, groups: list[torch.Tensor], ratio: float,
               floor: float = 0.0) -> list[torch.Tensor]:
    """Batched `select_top_reference` (see `select_top_padded`)."""
    return unpad(select_top_padded(dev, groups, ratio, floor))
