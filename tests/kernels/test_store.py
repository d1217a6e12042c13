"""KV store (and the query rotation beside it): the Triton pass (interpreted on CPU)
against the reference, which is index copies and rope_rotate_reference."""

from __future__ import annotations

import pytest
import torch

from tokendance.kernels.rope import rope_rotate_reference
from tokendance.kernels.store import store_reference, store_triton

INV = 1.0 / 1e4 ** (torch.arange(0, 64, 2).float() / 64)


def _case(dtype: torch.dtype, t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, 7 + 2 * 3, 64, generator=g) * 3).to(dtype)
    q, k, v = qkv[:, :7], qkv[:, 7:10], qkv[:, 10:]  # strided views, as the fused projection gives
    pos = torch.randint(0, 30000, (t,), generator=g)
    slots = torch.randperm(9 * 4, generator=g)[:t]  # any blocks, any offsets
    pool = (torch.randn(2, 9, 4, 3, 64, generator=g) * 3).to(dtype)
    return q, k, v, pos, slots, pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(dtype: torch.dtype) -> None:
    q, k, v, pos, slots, pool = _case(dtype, 13, 1)
    ref_pool, out_pool = pool.clone(), pool.clone()
    ref = store_reference(k, v, slots, *ref_pool, q, pos, INV, 0.9)
    out = store_triton(k, v, slots, *out_pool, q, pos, INV, 0.9)
    assert torch.equal(out_pool, ref_pool)  # copies: exact, and nothing else written
    assert out.dtype == dtype and out.shape == q.shape
    # bf16: within two ulps (the interpreter rounds to bf16 towards zero, a GPU to nearest)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    torch.testing.assert_close(ref, rope_rotate_reference(q, pos, INV, 0.9))


def test_without_queries_only_stores() -> None:
    _, k, v, pos, slots, pool = _case(torch.float32, 5, 2)
    before = pool.clone()
    assert store_triton(k, v, slots, *pool) is None
    flat = pool.view(2, -1, 3, 64)
    assert torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], before.view(2, -1, 3, 64)[:, untouched])


def test_no_tokens() -> None:
    q, k, v, pos, slots, pool = _case(torch.float32, 0, 3)
    assert store_triton(k, v, slots, *pool, q, pos, INV).shape == (0, 7, 64)


def test_shapes_checked() -> None:
    q, k, v, pos, slots, pool = _case(torch.float32, 4, 4)
    with pytest.raises(ValueError, match="k and v"):
        store_reference(k, v[:, :2], slots, *pool)
    with pytest.raises(ValueError, match="slots"):
        store_triton(k, v, slots[:3], *pool)
