"""K/V pools in 8-bit floats (kernels/fp8.py): a store narrows as `fp8.narrow` does, and
every reader casts the pool up to the queries' dtype. Each Triton kernel (interpreted)
against the reference over the same 8-bit pool, and the reference against itself over
that pool cast up."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tokendance.kernels.collective as col
import tokendance.kernels.paged_attention as pa
from tokendance.kernels import deviation as dv
from tokendance.kernels import diff, restore as rs
from tokendance.kernels.fp8 import as_bytes, limit, narrow
from tokendance.kernels.rotated import RotatedKeys
from tokendance.kernels.store import store_reference, store_triton

from . import test_collective as tc
from .test_diff import _pool
from .test_master_decode import batch, full_reference
from .test_paged_attention import make_case, rel, run_triton, suffix
from .test_restore import pool, some_slots
from .test_rotated import Batch, gathers
from .test_slot_positions import mirror_case, triton
from .test_store import _case

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def pools(c, f):
    """c (a dataclass with k_cache and v_cache) with f of its pools."""
    return dataclasses.replace(c, k_cache=f(c.k_cache), v_cache=f(c.v_cache))


def in8(c, dtype: torch.dtype = E4):
    return pools(c, lambda t: narrow(t, dtype))


def up(c, dtype: torch.dtype = torch.float32):
    return pools(c, lambda t: t.to(dtype))


# ---- the store ----

@pytest.mark.parametrize("dtype", [E4, E5])
def test_store_reference_saturates_and_rounds(dtype: torch.dtype) -> None:
    _, k, v, _, slots, p = _case(torch.float32, 9, 5)
    k[0, 0, 0], v[1, 2, 3] = 1e6, -1e6
    kc, vc = p.to(dtype)
    before = as_bytes(kc).clone()
    store_reference(k, v, slots, kc, vc)
    flat_k, flat_v = kc.view(-1, 3, 64), vc.view(-1, 3, 64)
    m = limit(dtype)
    assert m == {E4: 448.0, E5: 57344.0}[dtype]
    assert flat_k[slots[0], 0, 0].item() == m and flat_v[slots[1], 2, 3].item() == -m
    inside = k.abs() < m  # the rest as torch's cast rounds it (to nearest even)
    assert torch.equal(as_bytes(flat_k[slots][inside]), as_bytes(k[inside].to(dtype)))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(as_bytes(flat_k)[untouched], before.view(-1, 3, 64)[untouched])


@pytest.mark.parametrize("dtype", [E4, E5])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_store_triton_equals_reference(dtype: torch.dtype, src: torch.dtype) -> None:
    """Bytewise, rotation beside. The interpreter rounds float32 to 8 bits half away from
    zero, and not at all across a binade (Triton 3.9): K/V are 8-bit values and values
    past the limit here (a GPU's cvt.rn.satfinite rounds to nearest even)."""
    q, k, v, pos, slots, p = _case(src, 13, 6)
    for x in (k, v):
        x.copy_(narrow(x, dtype).to(src))
    k[0, 0, :4] = torch.tensor([1e5, -1e5, 6e4, -7e4])
    v[2, 1, 5] = -1e5
    ref_pool, out_pool = p.to(dtype), p.to(dtype)
    inv = 1.0 / 1e4 ** (torch.arange(0, 64, 2).float() / 64)
    ref = store_reference(k, v, slots, *ref_pool, q, pos, inv)
    out = store_triton(k, v, slots, *out_pool, q, pos, inv)
    assert torch.equal(as_bytes(out_pool), as_bytes(ref_pool))
    assert out.dtype == src and rel(out.float(), ref.float()) < 1e-2


# ---- paged attention ----

@pytest.mark.parametrize("kind,dtype", [("prefill", E4), ("chunked", E5), ("decode", E4)])
def test_paged_attention(kind: str, dtype: torch.dtype) -> None:
    lens = [37, 52, 19]
    nq = {"prefill": lens, "chunked": [5, 30, 19], "decode": [1, 1, 1]}[kind]
    c = in8(make_case(lens, suffix(lens, nq), hq=8, hkv=2), dtype)
    want = pa.paged_attention_reference(*c.args())
    assert rel(want, pa.paged_attention_reference(*up(c).args())) < 1e-6
    assert rel(run_triton(c, num_splits=4), want) < 1e-3


def test_paged_attention_bf16_queries() -> None:
    lens = [50, 29]
    c = make_case(lens, suffix(lens, [1, 1]), hq=8, hkv=2)
    c = in8(dataclasses.replace(c, q=c.q.bfloat16()), E5)
    want = pa.paged_attention_reference(*c.args())
    assert want.dtype == torch.bfloat16
    assert rel(want.float(), pa.paged_attention_reference(*up(c, torch.bfloat16).args()).float()) < 1e-6
    got = run_triton(c, num_splits=2)
    assert got.dtype == torch.bfloat16 and rel(got.float(), want.float()) < 2e-2


def test_slot_positions() -> None:
    c = mirror_case([40, 23], [30, 7], 45, [6, 1])
    *rest, kc, vc = c.args[:5]
    c8 = dataclasses.replace(c, args=(*rest, narrow(kc, E4), narrow(vc, E4), *c.args[5:]))
    want = pa.paged_attention_reference(*c8.args)
    wide = (*rest, c8.args[3].float(), c8.args[4].float(), *c.args[5:])
    assert rel(want, pa.paged_attention_reference(*wide)) < 1e-6
    assert rel(triton(c8), want) < 1e-3


# ---- the Master read collectively ----

@pytest.mark.parametrize("dtype", [E4, E5])
def test_collective(dtype: torch.dtype) -> None:
    c = in8(tc.make_case(3, 6, 2, 32, rope_scale=1.1), dtype)
    o, lse = col.collective_attention_reference(*c.args())
    wide_o, wide_lse = col.collective_attention_reference(*up(c).args())
    assert rel(o, wide_o) < 1e-6
    tc.check_lse(lse, wide_lse, 1e-6)
    got_o, got_lse = tc.run_triton(c, num_splits=2)
    assert rel(got_o, o) < 1e-3
    tc.check_lse(got_lse, lse, 1e-3)


def test_master_decode() -> None:
    torch.manual_seed(11)
    q, q_pos, cu, kc, vc, full, mine, read, f = batch([40, 30], [10, 25, None])
    kc, vc = narrow(kc, E4), narrow(vc, E4)
    own = (mine[0], mine[1], f, 1.0, 64 ** -0.5, mine[2], read)
    want = pa.master_decode_reference(q, q_pos, kc, vc, *own)
    assert rel(want, full_reference(q, q_pos, cu, kc.float(), vc.float(), full, f)) < 1e-5
    assert rel(pa.master_decode_triton(q, q_pos, cu, kc, vc, *own), want) < 1e-3


def test_held_rotated_keys(monkeypatch) -> None:
    """CPU decode over held keys (kernels/rotated.py) of an 8-bit pool, step by step."""
    calls = gathers(monkeypatch)
    b = Batch([9, 23, 16], E4, mirror=True, seed=2)
    keys = RotatedKeys(1 << 30, 1)
    for _ in range(5):
        got, want = b.step(keys, torch.float32)  # float32 queries, new K/V stored into 8 bits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 1


# ---- deviation, diff, restore ----

def test_deviation_reads_old_kv_in_float32() -> None:
    g = torch.Generator().manual_seed(4)
    kn, vn = (torch.randn(21, 3, 64, generator=g) for _ in range(2))
    ko, vo = (narrow(x + 0.1 * torch.randn(x.shape, generator=g), E4) for x in (kn, vn))
    want = dv.kv_deviation_reference(kn, vn, ko.float(), vo.float())
    assert torch.equal(dv.kv_deviation_reference(kn, vn, ko, vo), want)
    assert rel(dv.kv_deviation_triton(kn, vn, ko, vo), want) < 1e-5


def test_diff() -> None:
    kv = _pool(3, 6, 4, 2, 16, E4, seed=1)
    a, b = torch.arange(0, 4), torch.arange(20, 24)
    kv[:, :, 5] = kv[:, :, 0]  # block 5 copies block 0 ...
    as_bytes(kv)[2, 1, 5, 2, 1, 7] ^= 1  # ... but for one byte: token 2's V in layer 2
    ref = diff.kv_diff_reference(kv, a, b, 2)
    out = diff.kv_diff_triton(kv, a, b, 2)
    for r, o in zip(ref, out):
        assert torch.equal(r, o)
    assert ref[0].tolist() == [0.0] * 4
    assert ref[1][[0, 1, 3]].tolist() == [0.0] * 3 and ref[1][2] > 0


@pytest.mark.parametrize("move", ["triton", "reference"])
def test_restore_round_trip(move: str) -> None:
    """Every byte pattern (NaNs too) through a packed 8-bit buffer and back."""
    shape = (2, 3, 4, 2, 16)
    kv = torch.randint(0, 256, pool(shape, torch.float32, 0).shape, dtype=torch.uint8).view(E4)
    slots = some_slots(shape, 7, 1)
    gather, scatter = ((rs.gather_slots_triton, rs.scatter_slots_triton) if move == "triton"
                       else (rs.gather_slots_reference, rs.scatter_slots_reference))
    packed = gather(kv, slots)
    assert torch.equal(as_bytes(packed), as_bytes(rs.gather_slots_reference(kv, slots)))
    back = torch.zeros_like(as_bytes(kv)).view(E4)
    scatter(back, slots, packed)
    flat = lambda t: as_bytes(t).view(2, 2, -1, 2, 16)  # noqa: E731
    assert torch.equal(flat(back)[:, :, slots], flat(kv)[:, :, slots])
    named = torch.zeros(flat(back).shape[2], dtype=torch.bool)
    named[slots] = True
    assert not flat(back)[:, :, ~named].any()
