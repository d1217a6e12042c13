"""Head dims that are not a power of two (80 and 96, as some Llama-shaped checkpoints
have; 16, the least): every Triton kernel that tiles a head, interpreted, against its
torch reference. The kernels pad each half of a head to a power of two and mask the
columns past it; the pools' unwritten slots and the partial buffers start as NaN, so a
padded column that is read or written where it must not be shows in the result."""

from __future__ import annotations

import math

import pytest
import torch

import tokendance.kernels.collective as col
import tokendance.kernels.collective_triton as colt
import tokendance.kernels.paged_attention as pa
import tokendance.kernels.paged_triton as pt
from tokendance.kernels.jit import padded_half, tiles_head
from tokendance.kernels.rope import rope_rotate_reference, rope_rotate_triton
from tokendance.kernels.store import store_reference, store_triton
from tokendance.kernels.tiles import trig_table
from tests.kernels import test_collective as tc
from tests.kernels import test_master_decode as tm
from tests.kernels import test_paged_attention as tp
from tests.kernels import test_slot_positions as ts

DIMS = [96, 80, 16]


@pytest.fixture(autouse=True)
def poisoned(monkeypatch) -> None:
    nan = lambda *shape, device: torch.full(shape, math.nan)  # noqa: E731
    for mod in (pt, pa, colt):
        monkeypatch.setattr(mod, "_scratch", nan)


def test_the_padded_half_and_the_dims_tiled() -> None:
    assert [padded_half(d) for d in (16, 32, 48, 64, 80, 96, 128, 200, 256)] == [
        16, 16, 32, 32, 64, 64, 64, 128, 128]
    assert [d for d in (8, 15, 16, 80, 96, 100, 256, 258) if tiles_head(d)] == [16, 80, 96, 100, 256]


@pytest.mark.parametrize("d", DIMS)
def test_prefill(d: int) -> None:
    lens = [45, 17, 64]
    c = tp.make_case(lens, tp.suffix(lens, lens), hq=8, hkv=2, d=d, rope_scale=1.1)
    assert tp.rel(tp.run_triton(c), pa.paged_attention_reference(*c.args())) < 1e-3


@pytest.mark.parametrize("d,step", [(96, True), (96, "table"), (80, False)])
def test_chunked_prefill(d: int, step: bool | str) -> None:
    lens = [90, 41, 16]
    c = tp.make_case(lens, tp.suffix(lens, [13, 41, 3]), d=d)
    trig = trig_table(c.inv_freq, 96) if step == "table" else None
    got = tp.run_triton(c, cfg=dict(step=step), trig=trig)
    assert tp.rel(got, pa.paged_attention_reference(*c.args())) < 1e-3


@pytest.mark.parametrize("d,splits,step", [(96, 4, True), (80, 2, "table"), (16, 1, True)])
def test_decode(d: int, splits: int, step: bool | str) -> None:
    lens = [1, 15, 16, 17, 130]
    c = tp.make_case(lens, tp.suffix(lens, [1] * len(lens)), hq=12, hkv=4, d=d)
    trig = trig_table(c.inv_freq, 160) if step == "table" else None
    got = tp.run_triton(c, num_splits=splits, cfg=dict(step=step), trig=trig)
    assert tp.rel(got, pa.paged_attention_reference(*c.args())) < 1e-3


@pytest.mark.parametrize("d,nq", [(96, [6, 37, 2]), (80, [1, 1, 1])])
def test_slot_positions(d: int, nq: list[int]) -> None:
    """A Mirror's own slots at scattered positions and the Master's runs with holes."""
    c = ts.mirror_case([40, 23, 70], [30, 7, 51], 45, nq, hq=12, hkv=4, d=d)
    assert ts.rel(ts.triton(c, num_splits=2), pa.paged_attention_reference(*c.args)) < 1e-3


@pytest.mark.parametrize("d", [96, 80])
def test_master_decode(d: int) -> None:
    """The engine's Mirror decode: own part, the Master read collectively, one reduce."""
    torch.manual_seed(d)
    q, q_pos, cu, kc, vc, full, mine, read, f = tm.batch([40, 33, 70], [20, 5, 31], d=d)
    want = tm.full_reference(q, q_pos, cu, kc, vc, full, f)
    got = pa.master_decode_triton(q, q_pos, cu, kc, vc, mine[0], mine[1], f, 1.0, d ** -0.5,
                                  mine[2], read, trig=trig_table(f, 1024))
    assert tm.rel(got, want) < 1e-3


@pytest.mark.parametrize("d", DIMS)
def test_collective(d: int) -> None:
    c = tc.make_case(5, 6, 2, d, rope_scale=1.1)
    o, lse = tc.run_triton(c, num_splits=2)
    want_o, want_lse = col.collective_attention_reference(*c.args())
    assert tc.rel(o, want_o) < 1e-3
    tc.check_lse(lse, want_lse, 1e-3)


def test_decode_bf16() -> None:
    lens = [33, 70]
    c = tp.make_case(lens, tp.suffix(lens, [1, 1]), hq=8, hkv=2, d=96)
    got = tp.run_triton(c.to(torch.bfloat16), num_splits=2)
    want = pa.paged_attention_reference(*c.to(torch.bfloat16).to(torch.float32).args())
    assert got.dtype == torch.bfloat16 and tp.rel(got.float(), want) < 2e-2


@pytest.mark.parametrize("d", [96, 80, 120, 6])
def test_rope(d: int) -> None:
    g = torch.Generator().manual_seed(d)
    inv = 1.0 / 1e4 ** (torch.arange(0, d, 2).float() / d)
    qkv = torch.randn(21, 9 + 2 * 3, d, generator=g)
    q = qkv[:, :9]  # a strided view, as the model's fused projection gives it
    pos = torch.randint(0, 30000, (21,), generator=g)
    torch.testing.assert_close(rope_rotate_triton(q, pos, inv, 0.8), rope_rotate_reference(q, pos, inv, 0.8),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d", [96, 80, 120])
def test_store(d: int) -> None:
    g = torch.Generator().manual_seed(d)
    inv = 1.0 / 1e4 ** (torch.arange(0, d, 2).float() / d)
    qkv = torch.randn(13, 7 + 2 * 3, d, generator=g) * 3
    q, k, v = qkv[:, :7], qkv[:, 7:10], qkv[:, 10:]
    pos = torch.randint(0, 30000, (13,), generator=g)
    slots = torch.randperm(9 * 4, generator=g)[:13]
    pool = torch.randn(2, 9, 4, 3, d, generator=g)
    ref_pool, out_pool = pool.clone(), pool.clone()
    ref = store_reference(k, v, slots, *ref_pool, q, pos, inv, 0.9)
    out = store_triton(k, v, slots, *out_pool, q, pos, inv, 0.9)
    assert torch.equal(out_pool, ref_pool)  # the slots' heads whole, no column past them
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_strides_the_kernels_mark_but_that_break_the_mark_are_refused() -> None:
    """At head dim 120 the kernels tell the compiler that 8 divides every stride of a head
    (`jit.in_heads`); a view whose stride it does not divide is refused, not read wrong."""
    d = 120
    inv = 1.0 / 1e4 ** (torch.arange(0, d, 2).float() / d)
    kv = torch.randn(5, 2, 124)[:, :, :d]  # rows of 124: 8 does not divide the head stride
    pool = torch.zeros(2, 4, 4, 2, d)
    with pytest.raises(AssertionError):
        store_triton(kv, kv, torch.arange(5), *pool)
    with pytest.raises(AssertionError):
        rope_rotate_triton(kv, torch.arange(5), inv)
    c = tp.make_case([20], tp.suffix([20], [1]), hq=4, hkv=2, d=d)
    wide = torch.zeros(*c.k_cache.shape[:-1], 124)
    wide[..., :d] = c.k_cache
    with pytest.raises(AssertionError):
        pa.paged_attention_triton(c.q, c.q_pos, c.cu_q, wide[..., :d], wide[..., :d], c.block_tables, c.kv_lens,
                                  c.inv_freq, 1.0, d ** -0.5)
