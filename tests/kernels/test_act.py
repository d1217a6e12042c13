"""SwiGLU's silu(gate) * up: the Triton pass (interpreted on CPU) against the reference."""

from __future__ import annotations

import pytest
import torch

from tokendance.kernels.act import BLOCK, silu_mul_reference, silu_mul_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1536, 64, BLOCK])  # SmolLM2's intermediate size: a partial tile
def test_triton_matches_reference(dtype: torch.dtype, n: int) -> None:
    torch.manual_seed(n)
    wide = torch.randn(5, 2 * n + 8, dtype=dtype) * 4
    x = wide[:, : 2 * n]  # strided rows, as a slice of a larger output would be
    y = silu_mul_triton(x)
    assert y.shape == (5, n) and not y.isnan().any()
    # bf16: within two ulps (the interpreter rounds to bf16 towards zero, a GPU to nearest)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=1e-2)
    torch.testing.assert_close(y.float(), silu_mul_reference(x).float(), **tol)


def test_reference_is_the_definition() -> None:
    x = torch.randn(3, 10, dtype=torch.float64)
    g, u = x[:, :5], x[:, 5:]
    torch.testing.assert_close(silu_mul_reference(x), g / (1 + torch.exp(-g)) * u)


def test_no_rows() -> None:
    assert silu_mul_triton(torch.zeros(0, 8)).shape == (0, 4)
