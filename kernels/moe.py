"""Mixture-of-Experts expert computation: each token's hidden state through the k experts
its router chose, the outputs summed with the routing weights. It is Qwen3-MoE's
`Qwen3MoeExperts.forward` (transformers); the router and its top-k are the caller's.

Layout: x [T, H] (the normed hidden states); gate_up [E, 2I, H], per expert the gate
projection's rows, then the up projection's (nn.Linear's out x in); down [E, H, I];
weights [T, k] in x's dtype and ids [T, k] int64: each token's k distinct experts and
their routing weights. With e = ids[t, j]:
    out[t] = sum_j weights[t, j] * down[e] @ silu_mul(gate_up[e] @ x[t])

The reference is the definition and the CPU path in float32: a loop over the experts in
use, which reads them back to the host. In bf16 the CPU takes torch's grouped GEMM
(`moe_grouped`), faster there than the loop. The Triton path makes no host sync and no shape depends on
the routing, so a decode step that calls it can be captured into a CUDA graph. `align`
sorts the T*k (token, slot) pairs by expert on the device and pads each expert's group
to a multiple of BLOCK_M, in a list of a static length (the worst case of the padding);
a grouped GEMM then runs one program per (row block, column tile), every row block of a
single expert (blocks past the used ones return at once), gathering its rows of A and
scattering its results to their pairs' rows: x -> h [T*k, 2I] -> silu_mul -> [T*k, I]
-> times the routing weight -> y [T*k, H], then each token's k rows summed in float32.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tokendance.kernels.act import silu_mul, silu_mul_reference
from tokendance.kernels.jit import HAVE_TRITON, tl, triton
from tokendance.kernels.tiles import _dot

# Launch configurations on a GPU by the step's tokens: (from T, config). Picked on an H100
# (bf16, `bench/moe.py --sweep`, Qwen3-30B-A3B's and OLMoE-1B-7B's layers). Decode batches
# in a CUDA graph took 0.10-0.12 ms at one token and 0.35-0.70 ms at 32-256 under every
# configuration; 64 x 64 x 64 was within 1 % of the best at 32 and 256, 5 % at one. At
# 2,048 tokens 128 x 128 x 64 (8 warps) took 0.98 / 0.93 ms against 1.03 / 1.14 for
# 64 x 64 x 64, at 8,192 128 x 256 x 64 1.95 / 2.25 against 3.30 / 4.04 (torch's grouped
# GEMM: 3.00 / 3.23). At 1,024 and 4,096 (session 55) these were the best or within 1 %.
CFGS = ((0, dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)),
        (1024, dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)),
        (4096, dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)))
# The interpreter's small tiles keep tests fast and span several blocks and tiles.
INTERP_CFG = dict(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)


def moe_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The definition, expert by expert in ascending order, as transformers computes it."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():  # sorted
        j, t = torch.where(ids.t() == e)  # transformers' order: by slot, then token
        a = silu_mul_reference(F.linear(x[t], gate_up[e]))
        y = F.linear(a, down[e]) * weights[t, j, None]
        out.index_add_(0, t, y.to(out.dtype))
    return out


def by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the flat expert ids [T*k] int64, the pairs' order sorted by expert (stable), each
    expert's pair count [E] int64), on the device without a host sync."""
    flat = ids.reshape(-1).long()  # scatter_add_ takes int64 indices
    # scatter_add_, not bincount: CUDA's bincount reads its input's max back to the host
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return flat, torch.argsort(flat, stable=True), counts


def align_reference(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of ids [T, k] grouped by expert, each group padded to a multiple of block_m.

    Returns pairs [P] int32 (a flat pair index t*k + j, or T*k for padding) and
    block_expert [P // block_m] int32 (each row block's expert, -1 past the used ones),
    P = `padded_pairs`. Device-side, static shapes, no host sync. Within a group the pairs
    are in ascending order (stable sort).
    """
    n = ids.numel()
    dev = ids.device
    flat, order, counts = by_expert(ids, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # each group's end in `pairs`
    e = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[e]  # place in its group
    size = padded_pairs(n, num_experts, block_m)
    pairs = torch.full((size,), n, dtype=torch.int32, device=dev)
    pairs.scatter_(0, ends[e] - padded[e] + rank, order.to(torch.int32))
    starts = torch.arange(0, size, block_m, device=dev)
    blk = torch.searchsorted(ends, starts, right=True)  # the group whose range holds the block
    return pairs, torch.where(blk < num_experts, blk, -1).to(torch.int32)


def padded_pairs(n: int, num_experts: int, block_m: int) -> int:
    """`align`'s static length: n pairs, at most min(E, n) groups, each padded by less than
    block_m, rounded up to a multiple of block_m."""
    return (n + min(num_experts, n) * (block_m - 1) + block_m - 1) // block_m * block_m


@triton.jit
def _groups_kernel(e, n, groups, block_expert, n_blocks, E: tl.constexpr, EP: tl.constexpr,
                   BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """One program: each expert's first pair in the sorted ids e (a binary search per
    expert, all at once), its padded group's start, and every row block's expert."""
    x = tl.arange(0, EP)  # experts 0 .. E-1, and E: the end of the last group
    lo = tl.zeros([EP], dtype=tl.int32)
    hi = tl.zeros([EP], dtype=tl.int32) + n
    for _ in range(32):  # lower bound of x in e: n < 2^31
        mid = lo + (hi - lo) // 2
        go = lo < hi
        less = tl.load(e + mid, mask=go, other=0) < x
        lo = tl.where(go & less, mid + 1, lo)
        hi = tl.where(go & ~less, mid, hi)
    first = lo
    # group x's size: the next expert's first pair minus its own (one more search's worth,
    # read from `first` shifted through memory)
    tl.store(groups + 2 * EP + x, first)
    tl.debug_barrier()
    count = tl.load(groups + 2 * EP + x + 1, mask=x < E, other=0) - tl.where(x < E, first, 0)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(groups + x, first, mask=x < E)
    tl.store(groups + EP + x, ends - padded, mask=x < E)
    for b0 in range(0, n_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        # the group whose padded range holds the block: how many groups end at or before it
        g = tl.sum(((ends[None, :] <= (b * BLOCK_M)[:, None]) & (x < E)[None, :]).to(tl.int32), 1)
        tl.store(block_expert + b, tl.where(g < E, g, -1), mask=b < n_blocks)


@triton.jit
def _pairs_kernel(order, groups, block_expert, pairs, n, size, EP: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Slots of `pairs`: a block's r-th slot holds its expert's r-th pair, or n past them."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = j < size
    ex = tl.load(block_expert + j // BLOCK_M, mask=live, other=-1)
    used = ex >= 0
    exs = tl.where(used, ex, 0)
    first = tl.load(groups + exs, mask=used, other=0)
    r = j - tl.load(groups + EP + exs, mask=used, other=0)
    count = tl.load(groups + 2 * EP + exs + 1, mask=used, other=0) - first
    real = used & (r < count)
    src = tl.load(order + first + r, mask=real, other=0)
    tl.store(pairs + j, tl.where(real, src, n).to(tl.int32), mask=live)


def align_triton(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_reference` in a sort and two launches (it took some twenty small ops, each a
    launch: the host's time on a mixture's layer): CUDA, or CPU under TRITON_INTERPRET=1."""
    n = ids.numel()
    e, order = torch.sort(ids.reshape(-1), stable=True)
    size = padded_pairs(n, num_experts, block_m)
    ep = triton.next_power_of_2(num_experts + 1)
    groups = torch.empty(3 * ep + 1, dtype=torch.int32, device=ids.device)  # firsts, padded starts, scratch
    pairs = torch.empty(size, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    if n == 0:
        return pairs, block_expert
    _groups_kernel[(1,)](e, n, groups, block_expert, size // block_m, E=num_experts, EP=ep, BLOCK_M=block_m,
                         CHUNK=min(64, triton.next_power_of_2(size // block_m)))
    _pairs_kernel[(triton.cdiv(size, 1024),)](order, groups, block_expert, pairs, n, size, EP=ep,
                                              BLOCK_M=block_m, BLOCK=1024)
    return pairs, block_expert


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the Triton kernels on CUDA, the reference elsewhere."""
    fn = align_triton if HAVE_TRITON and ids.is_cuda else align_reference
    return fn(ids, num_experts, block_m)


@triton.jit
def _moe_gemm_kernel(a, w, c, pairs, block_expert, wts, N, K, n_pairs, s_a, s_we, s_wn, s_c,
                     TOPK: tl.constexpr, WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr):
    """c[rows, tile] = a[rows // TOPK] @ w[e]^T (times wts[rows] with WEIGHT) for the rows
    of one block of `pairs`, all of expert e; sentinel rows are masked."""
    b = tl.program_id(0)
    e = tl.load(block_expert + b)
    if e < 0:
        return
    rows = tl.load(pairs + b * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < n_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    ap = a + (rows // TOPK).to(tl.int64)[:, None] * s_a + offs_k[None, :]
    # W[e]^T as a [BLOCK_K, BLOCK_N] tile; an expert's offset may pass 2^31 elements
    wp = w + e.to(tl.int64) * s_we + offs_n.to(tl.int64)[None, :] * s_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        km = k0 + offs_k < K
        at = tl.load(ap, mask=valid[:, None] & km[None, :], other=0.0)
        wt = tl.load(wp, mask=km[:, None] & nm[None, :], other=0.0)
        acc = _dot(at, wt, acc, PREC)
        ap += BLOCK_K
        wp += BLOCK_K
    if WEIGHT:
        acc = acc * tl.load(wts + rows, mask=valid, other=0.0).to(tl.float32)[:, None]
    cp = c + rows.to(tl.int64)[:, None] * s_c + offs_n[None, :]
    tl.store(cp, acc.to(c.dtype.element_ty), mask=valid[:, None] & nm[None, :])


def _gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, pairs: torch.Tensor,
          block_expert: torch.Tensor, wts: torch.Tensor | None, topk: int, cfg: dict,
          prec: str) -> None:
    """c [T*k, N] = per pair, its row of a (row pair // topk) times its expert's w [E, N, K]^T."""
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.shape[0], triton.cdiv(n, cfg["block_n"]))
    _moe_gemm_kernel[grid](
        a, w, c, pairs, block_expert, c if wts is None else wts, n, k, c.shape[0],
        a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        TOPK=topk, WEIGHT=wts is not None, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"], PREC=prec, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def moe_triton(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor, cfg: dict | None = None) -> torch.Tensor:
    """The Triton path of `moe`, free of host syncs: CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1. cfg overrides the launch configuration."""
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("moe_triton needs CUDA tensors (or TRITON_INTERPRET=1)")
    T, H = x.shape
    E, I2, _ = gate_up.shape
    k = ids.shape[1]
    assert gate_up.dtype == down.dtype == x.dtype, (x.dtype, gate_up.dtype, down.dtype)
    assert gate_up.stride(-1) == 1 and down.stride(-1) == 1  # not copied: they are large
    if T == 0:
        return x.new_empty(0, H)
    c = {**(launch(T) if x.is_cuda else INTERP_CFG), **(cfg or {})}
    # as tiles.scales: the interpreter would multiply bf16 bit patterns as integers
    prec = "ieee" if x.dtype == torch.float32 else "tf32" if x.is_cuda else "upcast"
    pairs, block_expert = align(ids, E, c["block_m"])
    x = x.contiguous()
    h = torch.empty(T * k, I2, dtype=x.dtype, device=x.device)
    _gemm(x, gate_up, h, pairs, block_expert, None, k, c, prec)
    a = silu_mul(h)
    y = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
    _gemm(a, down, y, pairs, block_expert, weights.reshape(-1).contiguous(), 1, c, prec)
    return y.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)


GROUPED_MM = getattr(F, "grouped_mm", None)  # torch >= 2.10


def moe_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM (`F.grouped_mm`, as transformers' default path): the pairs
    sorted by expert, each expert's rows one group; no host sync either. The CPU's path in
    bf16: at 8 tokens of a GraniteMoE-1B layer (8 of 32 experts) 12.6 ms against the loop's
    19.8 on this 2-core Xeon, 42 against 45 at 512 tokens."""
    _, order, counts = by_expert(ids, gate_up.shape[0])
    rows = order // ids.shape[1]
    offs = counts.cumsum(0).to(torch.int32)  # each expert's last row + 1
    h = GROUPED_MM(x[rows], gate_up.transpose(1, 2), offs=offs)
    y = GROUPED_MM(silu_mul(h), down.transpose(1, 2), offs=offs) * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, rows, y)


def groupable(*ts: torch.Tensor) -> bool:
    """Whether F.grouped_mm takes these: 16-byte aligned rows and starts."""
    return GROUPED_MM is not None and all(
        t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]) for t in ts)


def launch(tokens: int) -> dict:
    """The launch configuration on a GPU for a step of this many tokens (CFGS)."""
    return next(c for start, c in reversed(CFGS) if tokens >= start)


def path(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> str:
    """Which implementation `moe` runs: "triton", "grouped" or "reference"."""
    if HAVE_TRITON and x.is_cuda:
        return "triton"
    if x.dtype != torch.float32 and groupable(x, gate_up, down):
        return "grouped"
    return "reference"


def moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
        ids: torch.Tensor) -> torch.Tensor:
    """Dispatch: on CUDA the Triton path (replayed in a CUDA graph at decode sizes; faster
    than torch's grouped GEMM at every size timed); on CPU the grouped GEMM in half
    precision and the reference in float32 (our exact reference stays exact)."""
    impl = {"triton": moe_triton, "grouped": moe_grouped, "reference": moe_reference}[path(x, gate_up, down)]
    return impl(x, gate_up, down, weights, ids)
