"""Decode over Mirrors with the Master read collectively (kernels/master.py's
MasterRead): the same attention as reading each Mirror's whole slot-position table, in
the reference and in the Triton kernels (interpreted)."""

from __future__ import annotations

import math

import pytest
import torch

import tokendance.kernels.paged_attention as pa
from tokendance.kernels.paged_triton import REDUCE_BLOCK
from tokendance.kernels.master import NOT_READ, MasterRead, plan_chunks
from tokendance.kernels.tiles import trig_table

B = 16


@pytest.fixture(autouse=True)
def poisoned(monkeypatch) -> None:
    """Partials start as NaN: a slot read but never written (a padding chunk's) poisons
    its row."""
    monkeypatch.setattr(pa, "_scratch", lambda *shape, device: torch.full(shape, math.nan))


def batch(segs: list[int], hists: list[int | None], hq: int = 8, hkv: int = 2, d: int = 64,
          patch: float = 0.15, dtype: torch.dtype = torch.float32, align: int = 16, target: int = 6):
    """Sequences over one Master of segments `segs` (block-aligned, in shuffled pool
    blocks): sequence s owns hists[s] history slots, then reads the segments in its own
    order (a random permutation), each with ~patch of its tokens replaced by private
    patches, then owns a tail of 3 generated tokens; hists[s] None is a plain sequence.
    Unwritten pool slots are NaN. Returns (q, q_pos, cu_q, k, v, the full tables and
    slot positions, the own tables and slot positions, the MasterRead, inv_freq)."""
    seg_blocks = [-(-n // B) for n in segs]
    own_max = max(h or 0 for h in hists) + sum(segs) + 3
    total = sum(seg_blocks) + len(hists) * (-(-own_max // B)) + 2
    kc = torch.full((total, B, hkv, d), math.nan, dtype=dtype)
    vc = torch.full((total, B, hkv, d), math.nan, dtype=dtype)
    free = torch.randperm(total).tolist()
    master = [free.pop() for _ in range(sum(seg_blocks))]
    starts = [sum(seg_blocks[:k]) * B for k in range(len(segs))]
    for k, n in enumerate(segs):
        for t in range(n):
            j = starts[k] + t
            kc[master[j // B], j % B] = torch.randn(hkv, d)
            vc[master[j // B], j % B] = torch.randn(hkv, d)
    chunks = plan_chunks(segs, B, target, align)
    S = len(hists)
    shift = torch.full((S, len(chunks)), NOT_READ, dtype=torch.int32)
    L = len(master) * B
    hide = torch.zeros(S, L, dtype=torch.uint8)
    full_t, full_p, own_t, own_p, q_pos = [], [], [], [], []
    for s, h in enumerate(hists):
        mine: list[int] = []
        pos: list[int] = []

        def own(p: int) -> None:
            if len(pos) % B == 0:
                mine.append(free.pop())
            i = len(pos)
            kc[mine[i // B], i % B] = torch.randn(hkv, d)
            vc[mine[i // B], i % B] = torch.randn(hkv, d)
            pos.append(p)

        p = 0
        for _ in range(h if h is not None else 40):
            own(p)
            p += 1
        seen = torch.full((L,), -1, dtype=torch.int32)
        if h is not None:
            for k in torch.randperm(len(segs)).tolist():
                for c, (lo, hi, base) in enumerate(chunks):
                    if base == starts[k]:
                        shift[s, c] = p
                for t in range(segs[k]):
                    if torch.rand(()) < patch:
                        hide[s, starts[k] + t] = 1
                        own(p + t)
                    else:
                        seen[starts[k] + t] = p + t
                p += segs[k]
        for _ in range(3):
            own(p)
            p += 1
        q_pos.append(p - 1)
        ot = torch.tensor(mine, dtype=torch.int32)
        op = torch.full((len(mine) * B,), -1, dtype=torch.int32)
        op[: len(pos)] = torch.tensor(pos, dtype=torch.int32)
        own_t.append(ot)
        own_p.append(op)
        full_t.append(torch.cat([ot, torch.tensor(master, dtype=torch.int32)]))
        full_p.append(torch.cat([op, seen]))

    def pad(ts: list[torch.Tensor], fill: int) -> torch.Tensor:
        w = max(len(t) for t in ts)
        return torch.stack([torch.cat([t, t.new_full((w - len(t),), fill)]) for t in ts])

    read = MasterRead(torch.tensor(master, dtype=torch.int32),
                          torch.tensor(chunks, dtype=torch.int32), shift, hide)
    full = (pad(full_t, 0), torch.tensor([len(t) * B for t in full_t], dtype=torch.int32),
            pad(full_p, -1))
    mine = (pad(own_t, 0), torch.tensor([len(t) * B for t in own_t], dtype=torch.int32),
            pad(own_p, -1))
    q = torch.randn(S, hq, d, dtype=dtype)
    inv_freq = 1.0 / 1e4 ** (torch.arange(0, d, 2).float() / d)
    return q, torch.tensor(q_pos), torch.arange(S + 1, dtype=torch.int32), kc, vc, full, mine, read, inv_freq


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not a.isnan().any()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def full_reference(q, q_pos, cu, kc, vc, full, inv_freq):
    tables, lens, pos = full
    return pa.paged_attention_reference(q, q_pos, cu, kc, vc, tables, lens, inv_freq, 1.0,
                                        q.shape[-1] ** -0.5, pos)


@pytest.mark.parametrize("segs,hists", [([40, 33, 70], [20, 5, 31]),
                                        ([150, 16, 1], [0, 64, None, 7]),
                                        ([90], [None, 12])])
def test_reference_equals_whole_tables(segs, hists):
    torch.manual_seed(len(segs) + len(hists))
    q, q_pos, cu, kc, vc, full, mine, read, f = batch(segs, hists)
    got = pa.paged_attention(q, q_pos, cu, kc, vc, mine[0], mine[1], f, 1.0, 64 ** -0.5,
                             slot_pos=mine[2], master=read)
    assert rel(got, full_reference(q, q_pos, cu, kc, vc, full, f)) < 1e-5


@pytest.mark.parametrize("segs,hists,target", [([40, 33, 70], [20, 5, 31], 6),
                                               ([150, 16, 1], [0, 64, None, 7], 3),
                                               ([90, 20], [None, 12, 3], 16)])
def test_triton_equals_reference(segs, hists, target):
    torch.manual_seed(7 * len(segs) + target)
    q, q_pos, cu, kc, vc, full, mine, read, f = batch(segs, hists, target=target)
    want = full_reference(q, q_pos, cu, kc, vc, full, f)
    out = torch.full_like(q, math.nan)
    got = pa.master_decode_triton(q, q_pos, cu, kc, vc, mine[0], mine[1], f, 1.0, 64 ** -0.5,
                                   mine[2], read, out=out)
    assert got is out
    assert rel(got, want) < 1e-3


def test_triton_bf16():
    torch.manual_seed(3)
    q, q_pos, cu, kc, vc, full, mine, read, f = batch([48, 30], [10, 25, 4], dtype=torch.bfloat16)
    want = full_reference(q.float(), q_pos, cu, kc.float(), vc.float(), full, f)
    got = pa.master_decode_triton(q, q_pos, cu, kc, vc, mine[0], mine[1], f, 1.0, 64 ** -0.5,
                                   mine[2], read)
    assert got.dtype == torch.bfloat16
    assert rel(got.float(), want) < 2e-2


def test_plan_chunks_cover_each_segment_once():
    lens = [40, 1, 70, 16]
    chunks = plan_chunks(lens, B, target=8, align=16)
    starts = [0, 48, 64, 144]
    for base, n in zip(starts, lens):
        mine = sorted((lo, hi) for lo, hi, b in chunks if b == base)
        assert mine[0][0] == base and mine[-1][1] == base + n
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
        assert all((hi - lo) % 16 == 0 or hi == base + n for lo, hi in mine)
    assert len(chunks) <= 8 + len(lens)
    assert plan_chunks([], B, 8, 16) == []


def test_triton_padding_chunks_are_skipped():
    """CUDA graphs pad the chunk list to a fixed count with empty chunks (0, 0, 0): their
    partial slots are neither written nor read (they stay NaN)."""
    torch.manual_seed(11)
    q, q_pos, cu, kc, vc, full, mine, read, f = batch([40, 33], [20, None, 6], target=2)
    c = read.chunks.shape[0]
    read = MasterRead(read.table, torch.cat([read.chunks, torch.zeros(5, 3, dtype=torch.int32)]),
                          torch.cat([read.shift, read.shift.new_zeros(3, 5)], 1), read.hide)
    assert read.chunks.shape[0] == c + 5
    got = pa.master_decode_triton(q, q_pos, cu, kc, vc, mine[0], mine[1], f, 1.0, 64 ** -0.5,
                                   mine[2], read)
    assert rel(got, full_reference(q, q_pos, cu, kc, vc, full, f)) < 1e-3


def test_triton_with_trig_table():
    torch.manual_seed(12)
    q, q_pos, cu, kc, vc, full, mine, read, f = batch([40, 33, 70], [20, 5, 31])
    got = pa.master_decode_triton(q, q_pos, cu, kc, vc, mine[0], mine[1], f, 1.0, 64 ** -0.5,
                                   mine[2], read, trig=trig_table(f, 1024))
    assert rel(got, full_reference(q, q_pos, cu, kc, vc, full, f)) < 1e-3


def test_triton_reduce_over_many_chunks():
    """More partials than one reduce block (REDUCE_BLOCK): 40 segments
    and 70 padding chunks, so that whole blocks of the merge hold only empty partials."""
    torch.manual_seed(13)
    segs = torch.randint(1, 20, (40,)).tolist()
    q, q_pos, cu, kc, vc, full, mine, read, f = batch(segs, [10, None, 3], target=40)
    pad = 70
    read = MasterRead(read.table, torch.cat([read.chunks, torch.zeros(pad, 3, dtype=torch.int32)]),
                      torch.cat([read.shift, read.shift.new_zeros(3, pad)], 1), read.hide)
    assert read.chunks.shape[0] > 3 * REDUCE_BLOCK
    got = pa.master_decode_triton(q, q_pos, cu, kc, vc, mine[0], mine[1], f, 1.0, 64 ** -0.5,
                                   mine[2], read)
    assert rel(got, full_reference(q, q_pos, cu, kc, vc, full, f)) < 1e-3
