"""Triton paged attention (interpreted on CPU) against the reference, and the reference
against a naive dense implementation."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

import tokendance.kernels.paged_attention as pa
import tokendance.kernels.paged_triton as pt
import tokendance.kernels.runs as runs
from tokendance.kernels.rope import rope_rotate
from tokendance.kernels.tiles import trig_table

B = 16
# Small tiles so that every case spans several key tiles and row blocks.
CFG = dict(block_m=32, block_n=16, num_warps=4, num_stages=1, step=True)


@dataclass
class Case:
    q: torch.Tensor
    q_pos: torch.Tensor
    cu_q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    kv_lens: torch.Tensor
    inv_freq: torch.Tensor
    rope_scale: float
    sm_scale: float

    def args(self) -> tuple:
        return (self.q, self.q_pos, self.cu_q, self.k_cache, self.v_cache, self.block_tables,
                self.kv_lens, self.inv_freq, self.rope_scale, self.sm_scale)

    def to(self, dtype: torch.dtype) -> Case:
        cast = lambda t: t.to(dtype)  # noqa: E731
        return Case(cast(self.q), self.q_pos, self.cu_q, cast(self.k_cache), cast(self.v_cache),
                    self.block_tables, self.kv_lens, self.inv_freq, self.rope_scale, self.sm_scale)


def make_case(kv_lens: list[int], q_pos: list[torch.Tensor], hq: int = 9, hkv: int = 3,
              d: int = 64, share: bool = False, rope_scale: float = 1.0,
              theta: float = 10000.0, block: int = B) -> Case:
    """Random pool of `block`-slot blocks, and queries. Block tables are shuffled; slots no
    sequence owns are NaN, so a kernel that reads past kv_len or a wrong block fails. share:
    every sequence's block 1 is sequence 0's block 0 (same physical keys at a different
    logical offset)."""
    B = block
    nblk = [(n + B - 1) // B for n in kv_lens]
    width = max(nblk)
    total = sum(nblk) + 3
    k_cache = torch.full((total, B, hkv, d), math.nan)
    v_cache = torch.full((total, B, hkv, d), math.nan)
    perm = torch.randperm(total).tolist()
    tables = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    for s, (n, nb) in enumerate(zip(kv_lens, nblk)):
        for i in range(nb):
            tables[s, i] = perm.pop()
            if share and s > 0 and i == 1:
                tables[s, i] = tables[0, 0]
            used = min(B, n - i * B)
            blk = int(tables[s, i])
            if share and s > 0 and i == 1:
                assert n >= 2 * B and kv_lens[0] >= B, "shared blocks must be full"
                continue
            k_cache[blk, :used] = torch.randn(used, hkv, d)
            v_cache[blk, :used] = torch.randn(used, hkv, d)
    qp = torch.cat(q_pos).long()
    cu = torch.tensor([0] + torch.tensor([len(p) for p in q_pos]).cumsum(0).tolist(),
                      dtype=torch.int32)
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    return Case(torch.randn(len(qp), hq, d), qp, cu, k_cache, v_cache, tables,
                torch.tensor(kv_lens, dtype=torch.int32), inv_freq, rope_scale, d ** -0.5)


def suffix(kv_lens: list[int], nq: list[int]) -> list[torch.Tensor]:
    return [torch.arange(n - m, n) for n, m in zip(kv_lens, nq)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not a.isnan().any(), "output has NaN: rows left unwritten or garbage read"
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_triton(c: Case, **kw) -> torch.Tensor:
    out = torch.full_like(c.q, math.nan)
    got = pa.paged_attention_triton(*c.args(), cfg={**CFG, **kw.pop("cfg", {})}, out=out, **kw)
    assert got is out
    return out


@pytest.fixture(autouse=True)
def scratch(monkeypatch) -> list[tuple]:
    """Decode partials start as NaN: a split that writes nothing poisons its rows. Returns
    the shapes asked for, which tells whether the decode kernel ran."""
    shapes = []

    def poisoned(*shape: int, device: torch.device) -> torch.Tensor:
        shapes.append(shape)
        return torch.full(shape, math.nan)
    monkeypatch.setattr(pt, "_scratch", poisoned)
    return shapes


def dense_attention(c: Case, window: int = 0, cap: float = 0.0) -> torch.Tensor:
    """Naive float64 attention: keys copied slot by slot, rotated whole, plain softmax;
    with a window, each query over the keys of its window; with a cap, scores capped
    (cap * tanh(s / cap))."""
    out = torch.empty(c.q.shape, dtype=torch.float64)
    g, B = c.q.shape[1] // c.k_cache.shape[2], c.k_cache.shape[1]
    for s, n in enumerate(c.kv_lens.tolist()):
        lo, hi = c.cu_q[s].item(), c.cu_q[s + 1].item()
        tab = c.block_tables[s].tolist()
        k = torch.stack([c.k_cache[tab[j // B], j % B] for j in range(n)]).double()
        v = torch.stack([c.v_cache[tab[j // B], j % B] for j in range(n)]).double()
        k = rope_rotate(k.float(), torch.arange(n), c.inv_freq, c.rope_scale).double()
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        scores = torch.einsum("thd,khd->htk", c.q[lo:hi].double(), k) * c.sm_scale
        if cap:
            scores = cap * torch.tanh(scores / cap)
        j, p = torch.arange(n)[None, :], c.q_pos[lo:hi, None]
        visible = (j <= p) & (j > p - window) if window else j <= p
        p = scores.masked_fill(~visible, -math.inf).softmax(-1)
        out[lo:hi] = torch.einsum("htk,khd->thd", p, v)
    return out


def scattered(n: int, m: int) -> torch.Tensor:
    """m distinct positions below n, unsorted, always including the last."""
    pos = torch.randperm(n - 1)[: m - 1]
    return torch.cat([pos, torch.tensor([n - 1])])[torch.randperm(m)]


# ---- the reference against the naive definition ----

@pytest.mark.parametrize("kind", ["prefill", "chunked", "decode", "scattered", "shared"])
def test_reference_matches_dense(kind: str) -> None:
    lens = [37, 70, 19]
    if kind == "prefill":
        c = make_case(lens, suffix(lens, lens), rope_scale=0.8)
    elif kind == "chunked":
        c = make_case(lens, suffix(lens, [5, 30, 19]))
    elif kind == "decode":
        c = make_case(lens, suffix(lens, [1, 1, 1]), hq=8, hkv=2, d=128)
    elif kind == "scattered":
        c = make_case(lens, [scattered(n, 6) for n in lens])
    else:
        c = make_case([40, 50], suffix([40, 50], [1, 17]), share=True)
    assert rel(pa.paged_attention_reference(*c.args()), dense_attention(c)) < 1e-5


def test_dispatcher_uses_reference_on_cpu() -> None:
    lens = [20, 33]
    c = make_case(lens, suffix(lens, [4, 1]))
    assert torch.equal(pa.paged_attention(*c.args()), pa.paged_attention_reference(*c.args()))


# ---- prefill kernel ----

@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 4, 128), (28, 4, 64)])
def test_prefill_from_scratch(hq: int, hkv: int, d: int, scratch: list[tuple]) -> None:
    lens = [45, 17, 64] if hq < 28 else [23, 9]
    c = make_case(lens, suffix(lens, lens), hq=hq, hkv=hkv, d=d, rope_scale=1.1)
    assert rel(run_triton(c), pa.paged_attention_reference(*c.args())) < 1e-3
    assert not scratch


@pytest.mark.parametrize("d,step", [(64, True), (128, True), (64, "table")])
def test_chunked_prefill(d: int, step: bool | str) -> None:
    lens = [90, 41, 16]
    c = make_case(lens, suffix(lens, [13, 41, 3]), d=d)
    trig = trig_table(c.inv_freq, 96) if step == "table" else None
    got = run_triton(c, cfg=dict(step=step), trig=trig)
    assert rel(got, pa.paged_attention_reference(*c.args())) < 1e-3


@pytest.mark.parametrize("step", [True, False])
def test_scattered_positions(step: bool) -> None:
    lens = [77, 52]
    c = make_case(lens, [scattered(77, 20), scattered(52, 9)])
    got = run_triton(c, cfg=dict(step=step))
    assert rel(got, pa.paged_attention_reference(*c.args())) < 1e-3


def test_prefill_shared_blocks_and_empty_sequence() -> None:
    lens = [32, 48, 40]
    c = make_case(lens, [torch.arange(24, 32), torch.arange(0, 0), torch.arange(30, 40)],
                  share=True)
    assert rel(run_triton(c), pa.paged_attention_reference(*c.args())) < 1e-3


def test_prefill_large_blocks() -> None:
    """A row block wider than a sequence's rows and key tiles wider than a page."""
    lens = [70, 33]
    c = make_case(lens, suffix(lens, [30, 33]), d=128)
    got = run_triton(c, cfg=dict(block_m=64, block_n=64))
    assert rel(got, pa.paged_attention_reference(*c.args())) < 1e-3


@pytest.mark.parametrize("block", [1, 8, 32])
@pytest.mark.parametrize("decode", [False, True])
def test_any_block_size(block: int, decode: bool) -> None:
    """vLLM's --block-size: key tiles across several small blocks or within one large one."""
    lens = [70, 33, 5]
    c = make_case(lens, suffix(lens, [1, 1, 1] if decode else [30, 33, 2]), block=block)
    want = pa.paged_attention_reference(*c.args())
    assert rel(want, dense_attention(c)) < 1e-5
    assert rel(run_triton(c), want) < 1e-3


# ---- decode kernel ----

@pytest.mark.parametrize("d,splits", [(64, 1), (64, 4), (128, 8)])
def test_decode_mixed_lengths(d: int, splits: int, scratch: list[tuple]) -> None:
    lens = [1, 15, 16, 17, 130]
    c = make_case(lens, suffix(lens, [1] * len(lens)), hq=28, hkv=4, d=d)
    got = run_triton(c, num_splits=splits)
    assert rel(got, pa.paged_attention_reference(*c.args())) < 1e-3
    assert scratch[0] == (5, 28, splits, d), "one query per sequence takes the decode kernel"


def test_decode_splits_fill_the_device_up_to_the_cap() -> None:
    """About per_sm programs per SM (2 SMs off a GPU), a power of two, 1 to 32."""
    cpu = torch.device("cpu")
    got = [pt.decode_splits(cpu, w) for w in (1, 2, 3, 8, 16, 100)]
    assert got == [16, 8, 8, 2, 1, 1]
    assert pt.decode_splits(cpu, 1, per_sm=32) == 32 == pt.decode_splits(cpu, 1, per_sm=64)
    assert pt.decode_splits(cpu, 4, per_sm=2) == 1


def test_decode_shared_blocks_some_sequences_idle() -> None:
    lens = [40, 64, 33, 50]
    c = make_case(lens, [torch.tensor([39]), torch.tensor([63]), torch.arange(0, 0),
                         torch.tensor([49])], share=True)
    got = run_triton(c, num_splits=2)
    assert rel(got, pa.paged_attention_reference(*c.args())) < 1e-3


def test_decode_query_before_the_end() -> None:
    """A decode query at position p < kv_len - 1 sees only keys <= p."""
    lens = [60, 45]
    c = make_case(lens, [torch.tensor([20]), torch.tensor([44])])
    got = run_triton(c, num_splits=4)
    assert rel(got, pa.paged_attention_reference(*c.args())) < 1e-3


@pytest.mark.parametrize("step", [True, False, "table"])
def test_decode_long_context(step: bool | str) -> None:
    """Positions in the thousands: RoPE angles far past 2 pi, many tiles per split; keys
    rotated per tile, per element, or from the cos/sin table."""
    lens = [2100, 1500]
    c = make_case(lens, suffix(lens, [1, 1]), hq=8, hkv=2, theta=1e6)
    trig = trig_table(c.inv_freq, 2200) if step == "table" else None
    got = run_triton(c, num_splits=4, cfg=dict(block_n=64, step=step), trig=trig)
    assert rel(got, pa.paged_attention_reference(*c.args())) < 1e-3


# ---- bf16 inputs, fp32 accumulation ----

@pytest.mark.parametrize("decode", [False, True])
def test_bf16(decode: bool) -> None:
    lens = [50, 29]
    c = make_case(lens, suffix(lens, [1, 1] if decode else [50, 7]), hq=8, hkv=2, d=128)
    ref32 = pa.paged_attention_reference(*c.to(torch.bfloat16).to(torch.float32).args())
    got = run_triton(c.to(torch.bfloat16), num_splits=2)
    assert got.dtype == torch.bfloat16
    assert rel(got.float(), ref32) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_split_equals_masked_call(monkeypatch, dtype: torch.dtype) -> None:
    """Queries of a sequence on CPU (kernels/runs.py): runs of MIN_RUN+ consecutive
    positions as chunks (prefix and own keys in two unmasked calls merged by lse), the
    other rows through the rest path (the keys before the first of them unmasked, the
    others masked); against all in one masked call, and the dense definition."""
    m = runs.MIN_RUN
    lens = [2 * m + 6, m + 5, m + 3, 3 * m]
    # a chunk after a prefix, a whole prompt (no prefix), a run of MIN_RUN after 3 keys,
    # and a shorter run from 0 with scattered queries (a Mirror's history and patches)
    short = torch.cat([torch.arange(0, m - 1), torch.tensor([m + 3, m + 4, 2 * m, 3 * m - 1])])
    c = make_case(lens, suffix(lens[:3], [m + 6, m + 5, m]) + [short]).to(dtype)
    calls, rest = [], []
    real_chunk, real_rest = runs.chunk_attention, runs.rest_attention
    monkeypatch.setattr(runs, "chunk_attention", lambda *a: calls.append(a[3]) or real_chunk(*a))
    monkeypatch.setattr(runs, "rest_attention", lambda *a: rest.append((len(a[0]), a[3].first)) or real_rest(*a))
    split = pa.paged_attention_reference(*c.args())
    assert sorted(calls) == [0, 3, m]  # prefix lengths of the runs
    assert rest == [(len(short), 0)]  # the short run among the scattered rows
    monkeypatch.setattr(pa, "FLASH_LSE", None)
    masked = pa.paged_attention_reference(*c.args())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel(split.float(), masked.float()) < tol
    assert rel(split.float(), dense_attention(c.to(torch.float32))) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("group", [runs.REST_GROUP, 3])
def test_rest_rows_share_the_keys_before_them(monkeypatch, group: int) -> None:
    """Scattered queries late in a sequence (a resumed agent's patches): masked calls of
    `group` rows over the keys from the first row's position to each group's last, then
    one unmasked call of all rows over the keys before the first; the dense definition."""
    monkeypatch.setattr(runs, "REST_GROUP", group)
    qp = torch.tensor([41, 44, 45, 52, 60, 61, 70, 88, 89, 99])
    c = make_case([100], [qp])
    seen = []
    real = runs.FLASH_LSE
    monkeypatch.setattr(runs, "FLASH_LSE", lambda q, k, *a, **kw: seen.append(
        (q.shape[2], k.shape[2], kw.get("attn_mask") is not None)) or real(q, k, *a, **kw))
    got = pa.paged_attention_reference(*c.args())
    assert rel(got, dense_attention(c)) < 1e-5
    groups = qp.split(group)
    assert seen == [(len(g), int(g[-1]) + 1 - 41, True) for g in groups] + [(10, 41, False)]


def test_prefill_plan_serves_every_layer(monkeypatch) -> None:
    """The layers of a step share a plan: how each sequence reads the pool is worked out
    once (one row split each), and a second layer's keys read through it give that
    layer's own attention."""
    m = runs.MIN_RUN
    lens = [m + 40, 90]
    q_pos = [torch.cat([torch.arange(0, m), torch.tensor([m + 5, m + 20, m + 39])]),
             torch.tensor([10, 11, 50, 89])]
    c = make_case(lens, q_pos)
    fresh = lambda t: torch.where(t.isnan(), t, torch.randn_like(t))  # noqa: E731
    layers = [c, dataclasses.replace(c, q=torch.randn_like(c.q), k_cache=fresh(c.k_cache),
                                     v_cache=fresh(c.v_cache))]
    splits = []
    real = pa.split_rows
    monkeypatch.setattr(pa, "split_rows", lambda *a: splits.append(1) or real(*a))
    plan: dict = {}
    for c in layers:
        assert rel(pa.paged_attention_reference(*c.args(), plan=plan), dense_attention(c)) < 1e-5
    assert len(splits) == 2 and len(plan) == 2
