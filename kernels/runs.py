"""The CPU path of paged prefill attention for one sequence: its query rows split into
runs and the rest, each part through torch's CPU flash kernel.

`paged_attention_reference` gathers a sequence's keys in position order; when they are
positions 0 .. L-1 (every plain sequence, and a Mirror with no Master slot hidden),
`split_rows` plans how its rows read them and `runs_attention` computes that plan:

- a run of at least MIN_RUN rows at consecutive positions is a chunk continuing its
  sequence: the keys before it in one unmasked call, its own keys in one causal call,
  merged by lse (a prefill, a chunk of one, a Mirror's history);
- the other rows (a blend's scattered patches, the short runs between them) see every
  key before the first of them: one unmasked call of all of them over those keys, then
  masked calls of REST_GROUP rows over the keys from there to each group's last row,
  merged by lse.

A masked call computes every score it is given, at ~0.8x an unmasked call's rate on
CPU, and more rows per call run faster. On a resumed agent's round (2 cores, SmolLM2,
N = 10) the rest path took 12.0 ms to 9.2 ms a sequence and layer against masked calls
of 64 rows over all keys; with the plan made once per step (AttnMeta.plan keeps it for
every layer) the round took 9.39 s to 7.83 s (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokendance.kernels.merge import merge_attention

MIN_RUN = 64  # consecutive query positions worth a chunk call of their own
REST_GROUP = 64  # the other rows: masked calls of this many, in position order

# CPU flash attention that also returns the log-sum-exp (what F.scaled_dot_product_attention
# runs on CPU, minus the lse); absent from some builds, then the caller's masked call serves.
FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(slots=True)
class Group:
    rows: slice  # of the rest rows (in position order)
    end: int  # keys first .. end-1 are read
    mask: torch.Tensor  # [rows, end - first] additive: -inf past each row's position


@dataclass(slots=True)
class Rows:
    """How one sequence's rows read its keys 0 .. L-1."""

    chunks: list[tuple[int, int, int]]  # (a, b, p): rows a .. b-1 at positions p ..
    rest: torch.Tensor | slice | None  # the other rows, in position order (a slice: all)
    first: int  # the first rest row's position
    groups: list[Group]


def split_rows(qp: torch.Tensor, dtype: torch.dtype) -> Rows:
    """The plan for rows at positions qp; masks in the queries' dtype."""
    cut = (torch.nonzero(qp[1:] != qp[:-1] + 1).flatten() + 1).tolist()
    bounds = [0] + cut + [len(qp)]
    chunks = [(a, b, int(qp[a])) for a, b in zip(bounds, bounds[1:]) if b - a >= MIN_RUN]
    left = torch.ones(len(qp), dtype=torch.bool)
    for a, b, _ in chunks:
        left[a:b] = False
    rest = torch.nonzero(left).flatten()
    if not len(rest):
        return Rows(chunks, None, 0, [])
    rest = rest[qp[rest].argsort()]
    rp = qp[rest]
    if len(rest) == len(qp) and bool((rest == torch.arange(len(qp))).all()):
        rest = slice(None)
    first = int(rp[0])
    groups = []
    for a in range(0, len(rp), REST_GROUP):
        g = slice(a, a + REST_GROUP)
        end = int(rp[g][-1]) + 1
        mask = torch.zeros(len(rp[g]), end - first, dtype=dtype)
        mask.masked_fill_(torch.arange(first, end)[None, :] > rp[g, None], float("-inf"))
        groups.append(Group(g, end, mask))
    return Rows(chunks, rest, first, groups)


def runs_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows,
                   sm_scale: float) -> torch.Tensor:
    """q [n, Hq, D] (rotated) over rotated keys k, v [L, Hkv, D] at positions 0 .. L-1,
    as `rows` plans it; [n, Hq, D] in q.dtype."""
    k = k.to(q.dtype)  # once for every part (float32 rotated keys, bf16 queries)
    out = torch.empty_like(q)
    for a, b, p in rows.chunks:
        out[a:b] = chunk_attention(q[a:b], k[: p + b - a], v[: p + b - a], p, sm_scale)
    if rows.rest is not None:
        out[rows.rest] = rest_attention(q[rows.rest], k, v, rows, sm_scale)
    return out


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[1, Hq, n, D] queries, [1, Hkv, L, D] keys and values: the CPU kernel groups the
    query heads that share a kv head itself."""
    return q.transpose(0, 1)[None].contiguous(), k.to(q.dtype).transpose(0, 1)[None], v.transpose(0, 1)[None]


def rest_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows,
                   sm_scale: float) -> torch.Tensor:
    """The rest rows q (in position order) over keys 0 .. L-1: masked groups over the keys
    from rows.first on, one unmasked call over those before it, merged."""
    n, hq, d = q.shape
    qh, kh, vh = _heads(q, k, v)
    first = rows.first
    o = torch.empty(1, hq, n, d, dtype=torch.float32)
    lse = torch.empty(1, hq, n, dtype=torch.float32)
    for g in rows.groups:
        og, lse[..., g.rows] = FLASH_LSE(qh[:, :, g.rows], kh[:, :, first:g.end], vh[:, :, first:g.end],
                                         0.0, False, attn_mask=g.mask, scale=sm_scale)
        o[:, :, g.rows] = og
    if first:
        o0, lse0 = FLASH_LSE(qh, kh[:, :, :first], vh[:, :, :first], 0.0, False, scale=sm_scale)
        o, lse = merge_attention(o0.float(), lse0, o, lse)
    return o[0].transpose(0, 1).to(q.dtype)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: int,
                    sm_scale: float) -> torch.Tensor:
    """Queries at positions p .. p+n-1 over keys 0 .. p+n-1 (rotated), as a chunked
    prefill continues its own sequence: the first p keys, seen by every query, and the
    chunk's own, causal, in two unmasked calls merged by their lse. One call with a mask
    would compute every score, twice the work at p = n, and CPU SDPA runs a mask slower
    per score than its causal path. [n, Hq, D] out, in q.dtype."""
    qh, kh, vh = _heads(q, k, v)
    o, lse = FLASH_LSE(qh, kh[:, :, p:], vh[:, :, p:], 0.0, True, scale=sm_scale)
    if p:
        o1, lse1 = FLASH_LSE(qh, kh[:, :, :p], vh[:, :, :p], 0.0, False, scale=sm_scale)
        o, lse = merge_attention(o1.float(), lse1, o.float(), lse)
    return o[0].transpose(0, 1).to(q.dtype)
