"""Diff encode kernel vs its reference, and what the reference means."""

from __future__ import annotations

import pytest
import torch

from tokendance.kernels import diff


def _pool(layers: int, blocks: int, size: int, heads: int, dim: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, blocks, size, heads, dim, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers,heads,dim,split", [(3, 2, 16, 1), (4, 3, 64, 0), (5, 4, 128, 5), (2, 1, 8, 1)])
def test_triton_matches_reference(dtype, layers, heads, dim, split):
    kv = _pool(layers, 6, 4, heads, dim, dtype, seed=layers * dim + split)
    g = torch.Generator().manual_seed(split)
    slots = 6 * 4
    a = torch.randint(0, slots, (17,), generator=g)
    b = torch.randint(0, slots, (17,), generator=g)
    b[:5] = a[:5]  # equal pairs: exactly 0 in both
    kv[:, :, 5] = kv[:, :, 0]  # and a block that copies another
    a[5:9], b[5:9] = torch.arange(0, 4), torch.arange(20, 24)
    ref = diff.kv_diff_reference(kv, a, b, split)
    out = diff.kv_diff_triton(kv, a, b, split)
    for r, o in zip(ref, out):
        assert torch.equal(r, o)  # max |x - y| is exact in float32 either way
    assert (ref[0][:9] == 0).all() and (ref[1][:9] == 0).all()


def test_reference_definition():
    kv = _pool(4, 3, 4, 2, 8, torch.float32, seed=0).round()  # small integers: exact sums
    kv[:, :, 1] = kv[:, :, 0]  # block 1 copies block 0
    a, b = torch.arange(0, 4), torch.arange(4, 8)
    kv[0, 1, 1, 2, 1, 3] += 0.5  # token 2: V of layer 0
    kv[3, 0, 1, 0, 0, 0] -= 2.0  # token 0: K of layer 3
    kv[1, 0, 1, 0, 1, 7] += 0.25  # token 0: K of layer 1
    early, late = diff.kv_diff_reference(kv, a, b, split=1)
    assert early.tolist() == [0.0, 0.0, 0.5, 0.0]
    assert late.tolist() == [2.0, 0.0, 0.0, 0.0]
    early, late = diff.kv_diff_reference(kv, a, b, split=2)
    assert early.tolist() == [0.25, 0.0, 0.5, 0.0]
    assert late.tolist() == [2.0, 0.0, 0.0, 0.0]
    early, late = diff.kv_diff_reference(kv, a, b, split=4)  # no late layers
    assert early.tolist() == [2.0, 0.0, 0.5, 0.0] and late.tolist() == [0.0] * 4


def test_no_pairs():
    kv = _pool(2, 2, 4, 1, 8, torch.float32, seed=1)
    none = torch.zeros(0, dtype=torch.long)
    for fn in (diff.kv_diff_reference, diff.kv_diff_triton, diff.kv_diff):
        early, late = fn(kv, none, none, 1)
        assert early.shape == late.shape == (0,)
