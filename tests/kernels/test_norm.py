"""RMSNorm with and without the residual add: Triton (interpreted on CPU) against the
reference, and the reference against the unfused definition."""

from __future__ import annotations

import pytest
import torch

from tokendance.kernels.norm import rms_norm_reference, rms_norm_triton


def unfused(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf / (xf.pow(2).mean(-1, keepdim=True) + eps).sqrt()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [576, 64])  # SmolLM2's hidden size (not a power of two)
@pytest.mark.parametrize("with_res", [False, True])
def test_triton_matches_reference(dtype: torch.dtype, n: int, with_res: bool) -> None:
    torch.manual_seed(n)
    big = torch.randn(7, 2 * n, dtype=dtype) * 3
    x = big[:, :n]  # strided rows
    res = torch.randn(7, n, dtype=dtype) if with_res else None
    w = (torch.rand(n) + 0.5).to(dtype)
    y, r = rms_norm_triton(x, w, 1e-6, res)
    y_ref, r_ref = rms_norm_reference(x, w, 1e-6, res)
    assert not y.isnan().any()
    # bf16: two ulps apart at most (the interpreter rounds to bf16 towards zero; a GPU
    # rounds to nearest, as torch does)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=1e-2)
    torch.testing.assert_close(y.float(), y_ref.float(), **tol)
    if with_res:
        torch.testing.assert_close(r.float(), r_ref.float(), **tol)
    else:
        assert r is None and r_ref is None


def test_reference_is_the_definition() -> None:
    x = torch.randn(5, 96, dtype=torch.float64)
    res = torch.randn(5, 96, dtype=torch.float64)
    w = torch.rand(96, dtype=torch.float64)
    y, r = rms_norm_reference(x, w, 1e-5, res)
    torch.testing.assert_close(r, x + res)
    torch.testing.assert_close(y, unfused(x + res, w, 1e-5), rtol=1e-6, atol=1e-6)
    rms = (y / w).pow(2).mean(-1)
    assert torch.allclose(rms, torch.ones(5, dtype=torch.float64), atol=1e-3)
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-5)[0], unfused(x, w, 1e-5), rtol=1e-6, atol=1e-6)


def test_empty_batch() -> None:
    y, r = rms_norm_triton(torch.empty(0, 64), torch.ones(64), 1e-6, torch.empty(0, 64))
    assert y.shape == (0, 64) and r.shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 576, 3584])
def test_reference_equals_the_written_out_ops_bit_for_bit(dtype: torch.dtype, n: int) -> None:
    """HF's RMSNorm is these ops; greedy equality with HF in fp32 rests on the same bits."""
    torch.manual_seed(n)
    x = torch.randn(33, n, dtype=dtype) * 3
    w = (torch.rand(n) + 0.5).to(dtype)
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(rms_norm_reference(x, w, 1e-5)[0], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_res", [False, True])
def test_offset_norm_is_gemmas(dtype: torch.dtype, with_res: bool) -> None:
    """Gemma's: the normalized row times 1 + weight in float32, rounded once (HF's
    Gemma3RMSNorm's ops, bit for bit in the reference); the kernel within two ulps (the
    interpreter rounds the residual's sum towards zero)."""
    torch.manual_seed(5)
    x = torch.randn(9, 640, dtype=dtype) * 3
    res = torch.randn(9, 640, dtype=dtype) if with_res else None
    w = (torch.randn(640) * 0.1).to(dtype)
    s = x if res is None else x + res
    sf = s.float()
    want = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).to(dtype)
    y, r = rms_norm_reference(x, w, 1e-6, res, offset=True)
    assert torch.equal(y, want) and y.dtype == dtype
    got, r2 = rms_norm_triton(x, w, 1e-6, res, offset=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=1e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert got.dtype == dtype and (r is None) == (r2 is None) == (res is None)
    assert not torch.allclose(rms_norm_reference(x, w, 1e-6, res)[0].float(), want.float(), atol=1e-2)
