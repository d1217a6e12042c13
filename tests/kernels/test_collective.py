"""Collective decode attention: the reference against a naive per-Mirror computation, the
Triton kernels (interpreted on CPU) against the reference, and merging partial results
against paged attention over each Mirror's whole cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import tokendance.kernels.collective as col
import tokendance.kernels.collective_triton as colt
from tokendance.kernels.merge import merge_attention
from tokendance.kernels.paged_attention import paged_attention_reference
from tokendance.kernels.rope import rope_rotate

B = 16
# Small tiles so that every case spans several key tiles, splits and row tiles.
CFG = dict(block_m=32, block_n=16, num_warps=4, num_stages=1)


@dataclass
class Case:
    q: torch.Tensor
    q_pos: torch.Tensor
    shift: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    master_table: torch.Tensor
    master_len: int
    hide: torch.Tensor
    inv_freq: torch.Tensor
    rope_scale: float
    sm_scale: float

    def args(self) -> tuple:
        return (self.q, self.q_pos, self.shift, self.k_cache, self.v_cache, self.master_table,
                self.master_len, self.hide, self.inv_freq, self.rope_scale, self.sm_scale)

    def to(self, dtype: torch.dtype) -> Case:
        return Case(self.q.to(dtype), self.q_pos, self.shift, self.k_cache.to(dtype),
                    self.v_cache.to(dtype), self.master_table, self.master_len, self.hide,
                    self.inv_freq, self.rope_scale, self.sm_scale)


def make_case(s: int, hq: int, hkv: int, d: int, master_len: int = 75, max_shift: int = 300,
              rope_scale: float = 1.0, theta: float = 1e4, block: int = B) -> Case:
    """Random Master in shuffled pool blocks of `block` slots; every other slot of the pool
    is NaN. Mirror 1 sees only the first half of the Master (causality), Mirror 2 none of
    it, the last of three or more hides every slot; the rest hide ~15 % of the slots at
    random."""
    B = block
    nb = -(-master_len // B)
    total = nb + 5
    k_cache = torch.full((total, B, hkv, d), math.nan)
    v_cache = torch.full((total, B, hkv, d), math.nan)
    table = torch.randperm(total)[:nb].int()
    for i, blk in enumerate(table.tolist()):
        used = min(B, master_len - i * B)
        k_cache[blk, :used] = torch.randn(used, hkv, d)
        v_cache[blk, :used] = torch.randn(used, hkv, d)
    shift = torch.randint(0, max_shift, (s,))
    q_pos = shift + master_len - 1 + torch.randint(0, 40, (s,))
    if s > 1:
        q_pos[1] = shift[1] + master_len // 2
    if s > 2:
        q_pos[2] = shift[2] - 1
    hide = torch.rand(s, master_len + 7) < 0.15
    if s > 2:
        hide[-1] = True
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    return Case(torch.randn(s, hq, d), q_pos, shift, k_cache, v_cache, table, master_len, hide,
                inv_freq, rope_scale, d ** -0.5)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not a.isnan().any(), "output has NaN: rows left unwritten or garbage read"
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_lse(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Same -inf entries, finite ones within tol."""
    assert not got.isnan().any()
    assert torch.equal(got.isinf(), want.isinf())
    fin = want.isfinite()
    assert (got[fin].double() - want[fin].double()).abs().max().item() < tol


def nothing_visible(c: Case) -> torch.Tensor:
    """[S] True for Mirrors that see no Master key."""
    t = torch.arange(c.master_len)
    vis = ~c.hide[:, : c.master_len] & (c.shift[:, None] + t[None, :] <= c.q_pos[:, None])
    return ~vis.any(1)


def run_triton(c: Case, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    s, hq, d = c.q.shape
    out = (torch.full((s, hq, d), math.nan), torch.full((s, hq), math.nan))
    got = colt.collective_attention_triton(*c.args(), cfg={**CFG, **kw.pop("cfg", {})},
                                          out=out, **kw)
    assert got[0] is out[0] and got[1] is out[1]
    return got


@pytest.fixture(autouse=True)
def scratch(monkeypatch) -> list[tuple]:
    """Partials start as NaN: a split that writes nothing poisons its rows."""
    shapes = []

    def poisoned(*shape: int, device: torch.device) -> torch.Tensor:
        shapes.append(shape)
        return torch.full(shape, math.nan)
    monkeypatch.setattr(colt, "_scratch", poisoned)
    return shapes


def naive(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64, per Mirror: its dense copy of the Master, slot by slot, rotated at shift+t,
    a plain softmax over its visible keys."""
    s_n, hq, d = c.q.shape
    g = hq // c.k_cache.shape[2]
    o = torch.zeros(s_n, hq, d, dtype=torch.float64)
    lse = torch.full((s_n, hq), -math.inf, dtype=torch.float64)
    tab = c.master_table.tolist()
    for s in range(s_n):
        n = c.master_len
        k = torch.stack([c.k_cache[tab[t // B], t % B] for t in range(n)]).float()
        v = torch.stack([c.v_cache[tab[t // B], t % B] for t in range(n)]).double()
        pos = int(c.shift[s]) + torch.arange(n)
        k = rope_rotate(k, pos, c.inv_freq, c.rope_scale).double()
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        vis = (pos <= int(c.q_pos[s])) & ~c.hide[s, :n]
        if not vis.any():
            continue
        scores = torch.einsum("hd,khd->hk", c.q[s].double(), k[vis]) * c.sm_scale
        o[s] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[vis])
        lse[s] = scores.logsumexp(-1)
    return o, lse


# ---- the reference ----

@pytest.mark.parametrize("s,hq,hkv,d", [(1, 2, 2, 32), (3, 6, 2, 64), (10, 28, 4, 32)])
def test_reference_matches_naive(s: int, hq: int, hkv: int, d: int) -> None:
    c = make_case(s, hq, hkv, d, rope_scale=0.9)
    o, lse = col.collective_attention_reference(*c.args())
    want_o, want_lse = naive(c)
    assert o.dtype == lse.dtype == torch.float32
    assert rel(o, want_o) < 1e-5
    check_lse(lse, want_lse, 1e-4)
    empty = nothing_visible(c)
    assert (s < 3 or empty[2] and empty[-1]) and (o[empty] == 0).all()


def test_dispatcher_uses_reference_on_cpu() -> None:
    c = make_case(3, 6, 2, 32)
    got, want = col.collective_attention(*c.args()), col.collective_attention_reference(*c.args())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bad_shapes() -> None:
    c = make_case(3, 6, 2, 32)
    bad = {
        "q_pos": (1, c.q_pos[:2]),
        "shift": (2, c.shift[:, None]),
        "q": (0, c.q[:, :5]),
        "hide": (7, c.hide[:, :70]),
        "table": (5, c.master_table[:3]),
        "inv_freq": (8, c.inv_freq[:8]),
    }
    for name, (i, val) in bad.items():
        args = list(c.args())
        args[i] = val
        for fn in (col.collective_attention_reference, colt.collective_attention_triton):
            with pytest.raises(ValueError):
                fn(*args)
    args = list(c.args())
    args[7] = c.hide.int()
    with pytest.raises(ValueError, match="bool"):
        col.collective_attention_reference(*args)


# ---- the Triton kernels ----

@pytest.mark.parametrize("s", [1, 3, 10])
@pytest.mark.parametrize("g,hkv,d", [(1, 2, 32), (3, 2, 64), (7, 4, 32)])
def test_triton_matches_reference(s: int, g: int, hkv: int, d: int, scratch: list[tuple]) -> None:
    c = make_case(s, g * hkv, hkv, d, rope_scale=1.1)
    o, lse = run_triton(c, num_splits=2)
    want_o, want_lse = col.collective_attention_reference(*c.args())
    assert rel(o, want_o) < 1e-3
    check_lse(lse, want_lse, 1e-3)
    assert (o[nothing_visible(c)] == 0).all()
    assert scratch[0] == (s, g * hkv, 2, d)


@pytest.mark.parametrize("block", [1, 8, 32])
def test_triton_any_block_size(block: int) -> None:
    """vLLM's --block-size: Master tiles across several small blocks or within one large one."""
    c = make_case(4, 6, 2, 32, block=block)
    o, lse = run_triton(c, num_splits=2)
    want_o, want_lse = col.collective_attention_reference(*c.args())
    assert rel(o, want_o) < 1e-3
    check_lse(lse, want_lse, 1e-3)


@pytest.mark.parametrize("cfg,splits", [
    (dict(block_m=16), 1),             # many row tiles
    (dict(block_n=32), 4),             # tiles across pages, some splits empty
    (dict(num_warps=8), 8),            # more splits than tiles
    (dict(block_m=128, block_n=64), 2),
])
def test_triton_launch_configs(cfg: dict, splits: int) -> None:
    c = make_case(10, 28, 4, 32, master_len=93)
    o, lse = run_triton(c, num_splits=splits, cfg=cfg)
    want_o, want_lse = col.collective_attention_reference(*c.args())
    assert rel(o, want_o) < 1e-3
    check_lse(lse, want_lse, 1e-3)


@pytest.mark.parametrize("master_len", [1, 9, 16])
def test_triton_short_master(master_len: int) -> None:
    c = make_case(3, 6, 2, 32, master_len=master_len)
    o, lse = run_triton(c)
    want_o, want_lse = col.collective_attention_reference(*c.args())
    assert rel(o, want_o) < 1e-3
    check_lse(lse, want_lse, 1e-3)


def test_triton_empty_master() -> None:
    c = make_case(3, 6, 2, 32)
    c.master_len = 0
    o, lse = run_triton(c)
    assert (o == 0).all() and (lse == -math.inf).all()


def test_triton_long_positions() -> None:
    """Shifts in the thousands and a long Master: angles far past 2 pi, many tiles."""
    c = make_case(3, 8, 2, 64, master_len=600, max_shift=9000, theta=1e6)
    o, lse = run_triton(c, num_splits=2, cfg=dict(block_n=64))
    want_o, want_lse = col.collective_attention_reference(*c.args())
    assert rel(o, want_o) < 1e-3
    check_lse(lse, want_lse, 1e-3)


def test_triton_bf16() -> None:
    c = make_case(10, 28, 4, 64)
    want_o, want_lse = col.collective_attention_reference(*c.to(torch.bfloat16).args())
    o, lse = run_triton(c.to(torch.bfloat16), num_splits=2)
    assert o.dtype == torch.float32
    assert rel(o, want_o) < 2e-2
    check_lse(lse, want_lse, 5e-2)


# ---- merging with the Mirrors' private parts ----

def test_merge_handles_empty_sides() -> None:
    o = torch.randn(2, 3, 8)
    lse = torch.tensor([[0.5, -math.inf, 2.0], [-math.inf, -math.inf, 1.0]])
    none = torch.full_like(lse, -math.inf)
    for got_o, got_lse in (merge_attention(o, lse, torch.zeros_like(o), none),
                           merge_attention(torch.zeros_like(o), none, o, lse)):
        fin = lse.isfinite()
        assert torch.allclose(got_o[fin], o[fin]) and (got_o[~fin] == 0).all()
        assert torch.equal(got_lse, lse)
    with pytest.raises(ValueError):
        merge_attention(o, lse, o[:1], lse[:1])


@pytest.mark.parametrize("master_kernel", ["reference", "triton"])
def test_merge_equals_attention_over_union(master_kernel: str) -> None:
    """Mirror s's cache is a private prefix (positions 0..P-1), the Master at P.., and a
    private tail ending at its query; hidden Master slots have private patches at their
    own positions. Master, patches, prefix and tail attended separately and merged equal
    paged attention over the dense cache holding all of it."""
    hq, hkv, d, m = 8, 2, 64, 45
    prefix, tail = [32, 0, 19], [1, 7, 20]
    s_n = len(prefix)
    c = make_case(s_n, hq, hkv, d, master_len=m, theta=1e6)
    c.hide[1] = False
    c.shift = torch.tensor(prefix)
    c.q_pos = c.shift + m + torch.tensor(tail) - 1
    k_pool, v_pool = [c.k_cache], [c.v_cache]
    n_blocks = c.k_cache.shape[0]

    def store(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """New pool blocks holding k, v [n, Hkv, D] (the rest NaN); their table."""
        nonlocal n_blocks
        nb = max(1, -(-k.shape[0] // B))
        kb = torch.full((nb * B, hkv, d), math.nan)
        vb = kb.clone()
        kb[: k.shape[0]], vb[: k.shape[0]] = k, v
        k_pool.append(kb.view(nb, B, hkv, d))
        v_pool.append(vb.view(nb, B, hkv, d))
        n_blocks += nb
        return torch.arange(n_blocks - nb, n_blocks, dtype=torch.int32)

    master_k = torch.cat([c.k_cache[b] for b in c.master_table.tolist()])[:m]
    master_v = torch.cat([c.v_cache[b] for b in c.master_table.tolist()])[:m]
    pieces, dense = [], []
    for s in range(s_n):
        pk, pv = torch.randn(prefix[s], hkv, d), torch.randn(prefix[s], hkv, d)
        tk, tv = torch.randn(tail[s], hkv, d), torch.randn(tail[s], hkv, d)
        hid = c.hide[s, :m]
        # Slots the Mirror did not recompute hold garbage that its hide mask must skip.
        patch_k, patch_v = torch.randn(m, hkv, d) * 50, torch.randn(m, hkv, d) * 50
        seen_k = torch.where(hid[:, None, None], patch_k, master_k)
        seen_v = torch.where(hid[:, None, None], patch_v, master_v)
        # (table, length, shift, hide) of the prefix, the patches and the tail
        pieces.append([(store(pk, pv), prefix[s], 0, None),
                       (store(patch_k, patch_v), m, prefix[s], ~c.hide[s : s + 1]),
                       (store(tk, tv), tail[s], prefix[s] + m, None)])
        dense.append(store(torch.cat([pk, seen_k, tk]), torch.cat([pv, seen_v, tv])))
    c.k_cache, c.v_cache = torch.cat(k_pool), torch.cat(v_pool)

    if master_kernel == "triton":
        o, lse = run_triton(c, num_splits=2)
    else:
        o, lse = col.collective_attention_reference(*c.args())
    for s in range(s_n):
        for table, n, shift, hide in pieces[s]:
            hide = torch.zeros(1, n, dtype=torch.bool) if hide is None else hide
            po, plse = col.collective_attention_reference(
                c.q[s : s + 1], c.q_pos[s : s + 1], torch.tensor([shift]), c.k_cache,
                c.v_cache, table, n, hide, c.inv_freq, c.rope_scale, c.sm_scale)
            merged = merge_attention(o[s : s + 1], lse[s : s + 1], po, plse)
            o[s : s + 1], lse[s : s + 1] = merged

    width = max(len(t) for t in dense)
    tables = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in dense])
    lens = torch.tensor([p + m + t for p, t in zip(prefix, tail)], dtype=torch.int32)
    want = paged_attention_reference(c.q, c.q_pos, torch.arange(s_n + 1, dtype=torch.int32),
                                     c.k_cache, c.v_cache, tables, lens, c.inv_freq,
                                     c.rope_scale, c.sm_scale)
    assert rel(o, want) < (1e-5 if master_kernel == "reference" else 1e-3)
    assert lse.isfinite().all()


def test_a_launch_short_of_shared_memory_takes_smaller_key_tiles(monkeypatch) -> None:
    """The collective kernel, refused at 64-key tiles (as wide heads in float32 may be),
    launches at 32 (`jit.fitting`) and gives the reference's result."""
    from tokendance.kernels import jit

    from .test_jit import Refusing

    monkeypatch.setattr(jit, "_FITS", {})
    tiles = []
    monkeypatch.setattr(colt, "_collective_kernel", Refusing(colt._collective_kernel, "BLOCK_N", 32, tiles))
    c = make_case(3, 8, 2, 64, master_len=93)
    o, lse = run_triton(c, num_splits=2, cfg=dict(block_n=64))
    want_o, want_lse = col.collective_attention_reference(*c.args())
    assert tiles == [64, 32] and rel(o, want_o) < 1e-3
    check_lse(lse, want_lse, 1e-3)
