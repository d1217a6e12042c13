"""gather_slots / scatter_slots: Triton (interpreter) against the reference, bit-exact."""

from __future__ import annotations

import math

import pytest
import torch

from tokendance.kernels import restore as rs

SHAPES = [(2, 3, 4, 2, 16), (3, 5, 8, 3, 32)]  # layers, blocks, B, Hkv, D (Hkv * D not 2^k in one)


def pool(shape, dtype, seed):
    layers, blocks, b, h, d = shape
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, blocks + 1, b, h, d, generator=g).to(dtype)


def some_slots(shape, n, seed):
    """n distinct slots in random order, whole blocks and parts of blocks."""
    _, blocks, b, _, _ = shape
    g = torch.Generator().manual_seed(seed)
    return torch.randperm((blocks + 1) * b, generator=g)[:n]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_matches_reference(shape, dtype):
    kv = pool(shape, dtype, 1)
    before = kv.clone()
    slots = some_slots(shape, 7, 2)
    out = torch.full((shape[0], 2, 7, shape[3], shape[4]), math.nan).to(dtype)
    got = rs.gather_slots_triton(kv, slots, out)
    want = rs.gather_slots_reference(kv, slots)
    assert got is out and torch.equal(got, want)
    assert torch.equal(want[1, 1, 3], kv[1, 1].flatten(0, 1)[slots[3]])
    assert torch.equal(kv, before)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_matches_reference(shape, dtype):
    layers, _, _, h, d = shape
    n = 11
    slots = some_slots(shape, n, 3)
    packed = torch.randn(layers, 2, n, h, d, generator=torch.Generator().manual_seed(4)).to(dtype)
    a = torch.full((layers, 2, shape[1] + 1, shape[2], h, d), math.nan).to(dtype)
    b = a.clone()
    rs.scatter_slots_triton(a, slots, packed)
    rs.scatter_slots_reference(b, slots, packed)
    assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    named = torch.zeros(a[0, 0].flatten(0, 1).shape[0], dtype=torch.bool)
    named[slots] = True
    flat = a.view(layers, 2, -1, h, d)
    assert torch.equal(flat[:, :, slots], packed)
    assert flat[:, :, ~named].isnan().all()  # slots not named are untouched


def test_strided_packed_round_trip():
    """The host tier's layout: packed as a permuted [n, layers, 2, Hkv, D] buffer."""
    shape = SHAPES[1]
    layers, _, _, h, d = shape
    kv = pool(shape, torch.bfloat16, 5)
    slots = some_slots(shape, 9, 6)
    buf = torch.full((9, layers, 2, h, d), math.nan).to(torch.bfloat16)
    rs.gather_slots_triton(kv, slots, buf.permute(1, 2, 0, 3, 4))
    assert torch.equal(buf.permute(1, 2, 0, 3, 4), rs.gather_slots_reference(kv, slots))
    dst = torch.full_like(kv, math.nan)
    back = some_slots(shape, 9, 7)
    rs.scatter_slots_triton(dst, back, buf.permute(1, 2, 0, 3, 4))
    assert torch.equal(dst.view(layers, 2, -1, h, d)[:, :, back], kv.view(layers, 2, -1, h, d)[:, :, slots])


def test_empty_slots():
    kv = pool(SHAPES[0], torch.float32, 8)
    none = torch.zeros(0, dtype=torch.long)
    assert rs.gather_slots(kv, none).shape == (2, 2, 0, 2, 16)
    rs.scatter_slots(kv, none, rs.gather_slots(kv, none))


@pytest.mark.parametrize("case,match", [
    ("kv5d", "layers, 2, blocks"),
    ("kvstride", "slot-major"),
    ("int32", "int64"),
    ("slots2d", "1-d"),
    ("range", r"lie in \[0, 16\)"),
    ("negative", "lie in"),
    ("pshape", "packed must be"),
    ("pdtype", "packed is"),
    ("prows", "contiguous"),
])
def test_bad_inputs_raise(case, match):
    kv = pool(SHAPES[0], torch.float32, 9)  # 3 blocks of 4 and the trash block: slots 0..15
    slots = torch.tensor([3, 0, 9])
    packed = rs.gather_slots(kv, slots)
    if case == "kv5d":
        kv = kv[0]
    elif case == "kvstride":
        kv = kv.transpose(4, 5)
    elif case == "int32":
        slots = slots.int()
    elif case == "slots2d":
        slots = slots[None]
    elif case == "range":
        slots = torch.tensor([3, 16, 9])
    elif case == "negative":
        slots = torch.tensor([3, -1, 9])
    elif case == "pshape":
        packed = packed[:, :, :2]
    elif case == "pdtype":
        packed = packed.double()
    elif case == "prows":
        packed = packed.transpose(3, 4).contiguous().transpose(3, 4)
    with pytest.raises(ValueError, match=match):
        if case.startswith("p"):
            rs.scatter_slots(kv, slots, packed)
        else:
            rs.gather_slots(kv, slots)
