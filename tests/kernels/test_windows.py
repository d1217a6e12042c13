"""Sliding windows (a query at p sees the keys at p - w + 1 .. p): the reference against a
naive definition, and every Triton path (interpreted) against the reference: prefill
from scratch and chunked, decode with splits, slot-position tables (Mirrors), and the
Master read collectively."""

from __future__ import annotations

import math

import pytest
import torch

import tokendance.kernels.paged_attention as pa
import tokendance.kernels.paged_triton as pt
from tokendance.kernels.tiles import trig_table

from .test_master_decode import batch
from .test_paged_attention import dense_attention, make_case, rel, run_triton, scattered, suffix


@pytest.fixture(autouse=True)
def poisoned(monkeypatch) -> None:
    """Partials start as NaN: a split or chunk that writes nothing poisons its row."""
    poison = lambda *shape, device: torch.full(shape, math.nan)  # noqa: E731
    monkeypatch.setattr(pt, "_scratch", poison)
    monkeypatch.setattr(pa, "_scratch", poison)


CASES = {
    "prefill": ([37, 70, 19], lambda lens: suffix(lens, lens)),
    "chunked": ([90, 41, 19], lambda lens: suffix(lens, [13, 30, 19])),
    "decode": ([37, 70, 19, 130], lambda lens: suffix(lens, [1] * 4)),
    "scattered": ([77, 52], lambda lens: [scattered(n, 9) for n in lens]),
}


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("window", [1, 7, 16, 45])
def test_reference_matches_dense(kind: str, window: int) -> None:
    lens, q_pos = CASES[kind]
    c = make_case(lens, q_pos(lens), hq=8, hkv=2)
    assert rel(pa.paged_attention_reference(*c.args(), window=window), dense_attention(c, window)) < 1e-5


def test_a_window_wider_than_every_context_changes_nothing() -> None:
    lens = [37, 70]
    c = make_case(lens, suffix(lens, [5, 1]))
    assert torch.equal(pa.paged_attention_reference(*c.args(), window=71), pa.paged_attention_reference(*c.args()))


# Windows below a key tile (16 interpreted), across tile boundaries, and past some contexts.
@pytest.mark.parametrize("kind", ["prefill", "chunked", "scattered"])
@pytest.mark.parametrize("window,step", [(5, True), (16, False), (33, "table"), (50, True)])
def test_triton_prefill(kind: str, window: int, step: bool | str) -> None:
    lens, q_pos = CASES[kind]
    c = make_case(lens, q_pos(lens), hq=8, hkv=2)
    trig = trig_table(c.inv_freq, 128) if step == "table" else None
    got = run_triton(c, cfg=dict(step=step), trig=trig, window=window)
    assert rel(got, pa.paged_attention_reference(*c.args(), window=window)) < 1e-3


@pytest.mark.parametrize("window,splits", [(1, 1), (7, 4), (40, 2), (129, 8), (500, 4)])
def test_triton_decode(window: int, splits: int) -> None:
    lens = [1, 15, 17, 64, 130]
    c = make_case(lens, suffix(lens, [1] * len(lens)), hq=8, hkv=2)
    got = run_triton(c, num_splits=splits, window=window)
    assert rel(got, pa.paged_attention_reference(*c.args(), window=window)) < 1e-3


def test_triton_decode_long_context_from_the_table() -> None:
    lens = [2100, 1500]
    c = make_case(lens, [torch.tensor([2099]), torch.tensor([700])], hq=8, hkv=2, theta=1e6)
    trig = trig_table(c.inv_freq, 2200)
    got = run_triton(c, num_splits=4, cfg=dict(block_n=64, step="table"), trig=trig, window=300)
    assert rel(got, pa.paged_attention_reference(*c.args(), window=300)) < 1e-3


@pytest.mark.parametrize("decode", [False, True])
def test_triton_bf16(decode: bool) -> None:
    lens = [50, 29]
    c = make_case(lens, suffix(lens, [1, 1] if decode else [50, 7]), hq=8, hkv=2, d=128)
    ref = pa.paged_attention_reference(*c.to(torch.bfloat16).to(torch.float32).args(), window=20)
    got = run_triton(c.to(torch.bfloat16), num_splits=2, window=20)
    assert rel(got.float(), ref) < 2e-2


# ---- Mirrors: slot-position tables, and the Master read collectively ----

@pytest.mark.parametrize("window", [3, 24, 70])
def test_mirror_tables(window: int) -> None:
    """Decode over whole slot-position tables (the Master's blocks among a Mirror's),
    and a prefill of the last three rows of each: Triton equals the reference."""
    q, q_pos, cu, kc, vc, full, _, _, inv = batch([40, 25], [12, 30, None])
    tables, lens, pos = full
    args = (q, q_pos, cu, kc, vc, tables, lens, inv, 1.0, q.shape[-1] ** -0.5)
    ref = pa.paged_attention_reference(*args, pos, window=window)
    got = pa.paged_attention_triton(*args, pos, num_splits=4, window=window)
    assert rel(got, ref) < 1e-3
    rows = torch.stack([q_pos - 2, q_pos - 1, q_pos], 1).flatten()
    qq = torch.randn(len(rows), *q.shape[1:])
    cu3 = torch.arange(0, len(rows) + 1, 3, dtype=torch.int32)
    args = (qq, rows, cu3, kc, vc, tables, lens, inv, 1.0, q.shape[-1] ** -0.5, pos)
    got = pa.paged_attention_triton(*args, cfg=dict(block_m=16, block_n=16, step=False), window=window)
    assert rel(got, pa.paged_attention_reference(*args, window=window)) < 1e-3


@pytest.mark.parametrize("window", [2, 30, 64])
def test_master_read(window: int) -> None:
    """The Master apart (read collectively) equals the whole tables, in the reference and
    in Triton, with the window cutting through the Master's segments."""
    q, q_pos, cu, kc, vc, full, mine, read, inv = batch([40, 25, 33], [12, 30, 5, None])
    sm = q.shape[-1] ** -0.5
    want = pa.paged_attention_reference(q, q_pos, cu, kc, vc, *full[:2], inv, 1.0, sm, full[2], window=window)
    ref = pa.paged_attention(q, q_pos, cu, kc, vc, *mine[:2], inv, 1.0, sm, slot_pos=mine[2], master=read,
                             window=window)
    assert rel(ref, want) < 1e-5
    got = pa.master_decode_triton(q, q_pos, cu, kc, vc, *mine[:2], inv, 1.0, sm, mine[2], read, window=window)
    assert rel(got, ref) < 1e-3
