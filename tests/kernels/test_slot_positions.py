"""Paged attention through slot-position tables (how Mirrors read the Master): the
reference against a naive definition, the Triton kernels (interpreted) against the
reference."""

from __future__ import annotations

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
CFG = dict(block_m=32, block_n=16, num_warps=4, num_stages=1, step=True)


@dataclass
class Case:
    args: tuple  # paged_attention's positional arguments, slot_pos last
    slots: list[list[tuple[int, int]]]  # per sequence: visible (flat slot, position)


def mirror_case(own: list[int], shifts: list[int], master_len: int, nq: list[int],
                hq: int = 8, hkv: int = 2, d: int = 64, hide: float = 0.15) -> Case:
    """Sequences that own `own[s]` private slots (positions scattered over their
    prompt) and read one shared Master of master_len slots at shifts[s], with a random
    ~15 % of the Master hidden per sequence. Pool slots nobody wrote are NaN."""
    m_blocks = -(-master_len // B)
    o_blocks = [-(-n // B) for n in own]
    total = m_blocks + sum(o_blocks) + 2
    kc = torch.full((total, B, hkv, d), math.nan)
    vc = torch.full((total, B, hkv, d), math.nan)
    perm = torch.randperm(total).tolist()
    master = [perm.pop() for _ in range(m_blocks)]
    for j in range(master_len):
        kc[master[j // B], j % B] = torch.randn(hkv, d)
        vc[master[j // B], j % B] = torch.randn(hkv, d)
    width = m_blocks + max(o_blocks)
    tables = torch.zeros(len(own), width, dtype=torch.int32)
    slot_pos = torch.full((len(own), width * B), -1, dtype=torch.int32)
    lens, visible, q_pos = [], [], []
    for s, (n, shift) in enumerate(zip(own, shifts)):
        mine = [perm.pop() for _ in range(o_blocks[s])]
        # Private positions: everything below shift, then past the Master, shuffled.
        pos = list(range(shift)) + list(range(shift + master_len, shift + master_len + n - shift))
        pos = torch.tensor(pos)[torch.randperm(n)]
        blocks = mine + master
        tables[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        seen = []
        for i in range(n):
            kc[mine[i // B], i % B] = torch.randn(hkv, d)
            vc[mine[i // B], i % B] = torch.randn(hkv, d)
            slot_pos[s, i] = int(pos[i])
            seen.append((mine[i // B] * B + i % B, int(pos[i])))
        base = len(mine) * B
        shown = torch.rand(master_len) >= hide
        for t in range(master_len):
            if shown[t]:
                slot_pos[s, base + t] = shift + t
                seen.append((master[t // B] * B + t % B, shift + t))
        lens.append(base + master_len)
        visible.append(seen)
        end = n + master_len
        q_pos.append(torch.arange(end - nq[s], end))
    qp = torch.cat(q_pos)
    cu = torch.tensor([0] + torch.tensor(nq).cumsum(0).tolist(), dtype=torch.int32)
    inv_freq = 1.0 / 1e4 ** (torch.arange(0, d, 2).float() / d)
    args = (torch.randn(len(qp), hq, d), qp, cu, kc, vc, tables,
            torch.tensor(lens, dtype=torch.int32), inv_freq, 1.0, d ** -0.5, slot_pos)
    return Case(args, visible)


def naive(c: Case) -> torch.Tensor:
    q, q_pos, cu, kc, vc = c.args[:5]
    inv_freq, scale = c.args[7], c.args[9]
    out = torch.empty(q.shape, dtype=torch.float64)
    g = q.shape[1] // kc.shape[2]
    for s, seen in enumerate(c.slots):
        lo, hi = int(cu[s]), int(cu[s + 1])
        slots = torch.tensor([a for a, _ in seen])
        pos = torch.tensor([p for _, p in seen])
        k = kc.flatten(0, 1)[slots]
        v = vc.flatten(0, 1)[slots].double().repeat_interleave(g, 1)
        k = rope_rotate(k, pos, inv_freq).double().repeat_interleave(g, 1)
        scores = torch.einsum("thd,khd->htk", q[lo:hi].double(), k) * scale
        ok = pos[None, :] <= q_pos[lo:hi, None]
        out[lo:hi] = torch.einsum("htk,khd->thd", scores.masked_fill(~ok, -math.inf).softmax(-1), v)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not a.isnan().any(), "output has NaN: a hidden or unwritten slot was read"
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def triton(c: Case, **kw) -> torch.Tensor:
    out = torch.full_like(c.args[0], math.nan)
    *args, slot_pos = c.args
    return pt.paged_attention_triton(*args, slot_pos, cfg={**CFG, **kw.pop("cfg", {})},
                                     out=out, **kw)


@pytest.mark.parametrize("nq", [[1, 1, 1], [5, 40, 1]])
def test_reference_matches_naive(nq: list[int]) -> None:
    c = mirror_case([40, 23, 70], [30, 7, 51], 45, nq)
    assert rel(pa.paged_attention_reference(*c.args), naive(c)) < 1e-5


@pytest.mark.parametrize("nq", [[1, 1], [4, 9]])
def test_slot_index_positions_equal_plain_table(nq: list[int]) -> None:
    """slot_pos[s, j] = j gives what the plain path gives."""
    lens = torch.tensor([37, 50], dtype=torch.int32)
    kc, vc = torch.randn(10, B, 2, 64), torch.randn(10, B, 2, 64)
    tables = torch.randperm(10)[:8].view(2, 4).int()
    q_pos = torch.cat([torch.arange(int(n) - m, int(n)) for n, m in zip(lens, nq)])
    cu = torch.tensor([0, nq[0], sum(nq)], dtype=torch.int32)
    inv = 1.0 / 1e4 ** (torch.arange(0, 64, 2).float() / 64)
    args = (torch.randn(len(q_pos), 8, 64), q_pos, cu, kc, vc, tables, lens, inv, 1.0, 0.125)
    index = torch.arange(4 * B, dtype=torch.int32).expand(2, -1)
    plain = pa.paged_attention_reference(*args)
    assert torch.allclose(pa.paged_attention_reference(*args, index), plain, atol=1e-5)


@pytest.mark.parametrize("nq", [[6, 37, 2], [20, 20, 20]])
def test_triton_prefill(nq: list[int]) -> None:
    c = mirror_case([40, 23, 70], [30, 7, 51], 45, nq, hq=28, hkv=4)
    assert rel(triton(c), pa.paged_attention_reference(*c.args)) < 1e-3


@pytest.mark.parametrize("splits,block_n", [(1, 16), (4, 16), (2, 32)])
def test_triton_decode(splits: int, block_n: int) -> None:
    """Tiles of own slots (scattered positions) and of the Master (consecutive runs with
    holes); 32-key tiles also straddle the two."""
    c = mirror_case([40, 23, 70, 17], [30, 7, 51, 0], 77, [1, 1, 1, 1], d=128)
    got = triton(c, num_splits=splits, cfg=dict(block_n=block_n))
    assert rel(got, pa.paged_attention_reference(*c.args)) < 1e-3


def test_split_of_hidden_slots_only() -> None:
    """A split that sees only hidden slots contributes nothing (no NaN)."""
    c = mirror_case([16, 16], [16, 16], 64, [1, 1], hide=1.0)
    got = triton(c, num_splits=4)
    assert rel(got, pa.paged_attention_reference(*c.args)) < 1e-3


def test_bf16_decode() -> None:
    c = mirror_case([40, 23], [30, 7], 45, [1, 1], d=128)
    args32 = tuple(a.bfloat16().float() if isinstance(a, torch.Tensor) and a.is_floating_point()
                   and a.dim() > 1 else a for a in c.args)
    bf = tuple(a.bfloat16() if isinstance(a, torch.Tensor) and a.is_floating_point()
               and a.dim() > 1 else a for a in c.args)
    got = triton(Case(bf, c.slots), num_splits=2)
    assert got.dtype == torch.bfloat16
    assert rel(got.float(), pa.paged_attention_reference(*args32)) < 2e-2


@pytest.mark.parametrize("nq", [[1, 1, 1], [6, 37, 2]])
def test_trig_table_equals_computed_angles(nq: list[int]) -> None:
    """Scattered tiles read cos/sin from the table: the same attention (decode, prefill)."""
    c = mirror_case([40, 23, 70], [30, 7, 51], 45, nq, hq=28, hkv=4)
    trig = trig_table(c.args[7], 512)
    assert trig.shape == (2, 512, 32)
    got = triton(c, trig=trig)
    assert rel(got, pa.paged_attention_reference(*c.args)) < 1e-3
    assert rel(got, triton(c)) < 1e-5


@pytest.mark.parametrize("group", [runs.REST_GROUP, 2])
def test_reference_over_a_patched_mirror_takes_runs(monkeypatch, group: int) -> None:
    """A blend's later layers: each Mirror's queries are its history (positions from 0, a
    run) and scattered tokens. With no Master slot hidden the sorted keys are positions
    0 .. P, so the runs go through the chunk path and the scattered rows through the
    rest path (masked calls of `group` rows); it must equal the naive definition."""
    monkeypatch.setattr(runs, "REST_GROUP", group)
    m = runs.MIN_RUN
    c = mirror_case([m + 40, m + 30], [m + 6, m], 48, [1, 1], hide=0.0)
    q_pos = [torch.cat([torch.arange(0, m + 6), torch.tensor([11, 18, 19, 53, 83]) + m]),
             torch.cat([torch.arange(0, m), torch.tensor([1, 47, 77]) + m])]
    qp = torch.cat(q_pos)
    cu = torch.tensor([0, len(q_pos[0]), len(qp)], dtype=torch.int32)
    c = Case((torch.randn(len(qp), *c.args[0].shape[1:]), qp, cu) + c.args[3:], c.slots)
    calls = []
    real = runs.chunk_attention
    monkeypatch.setattr(runs, "chunk_attention", lambda *a: calls.append(a[3]) or real(*a))
    assert rel(pa.paged_attention_reference(*c.args), naive(c)) < 1e-5
    assert calls == [0, 0]  # each history run from position 0; the scattered rows the rest path
