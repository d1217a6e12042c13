"""RoPE cos/sin tables: cached per inv_freq, never stale."""

import torch

from tokendance.kernels.rope import rope_cos_sin


def test_cos_sin_exact_for_each_fresh_inv_freq() -> None:
    """Tensors freed and reallocated (often at the same address) with other values must
    not be served an earlier tensor's table."""
    d, pos = 64, torch.arange(50)
    for i in range(60):
        theta = (1e4, 1e6, 5e5)[i % 3]
        inv = torch.empty(d // 2)
        inv.copy_(1.0 / theta ** (torch.arange(0, d, 2).float() / d))
        cos, sin = rope_cos_sin(pos, inv, 0.9)
        ang = pos.float()[:, None] * inv[None, :]
        assert torch.equal(cos, ang.cos() * 0.9) and torch.equal(sin, ang.sin() * 0.9)


def test_triton_rotation_matches_reference() -> None:
    import pytest

    from tokendance.kernels.rope import rope_rotate_reference, rope_rotate_triton

    g = torch.Generator().manual_seed(3)
    inv = 1.0 / 1e4 ** (torch.arange(0, 64, 2).float() / 64)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        qkv = torch.randn(37, 9 + 2 * 3, 64, generator=g).to(dtype)
        q = qkv[:, :9]  # a strided view, as the model's fused projection gives it
        pos = torch.randint(0, 30000, (37,), generator=g)
        ref = rope_rotate_reference(q, pos, inv, 0.8)
        out = rope_rotate_triton(q, pos, inv, 0.8)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < tol, (dtype, err)
        assert out.dtype == dtype and not torch.isnan(out).any()
    with pytest.raises(AssertionError):
        rope_rotate_triton(torch.randn(2, 2, 5), torch.arange(2), inv[:2])  # RoPE pairs halves
