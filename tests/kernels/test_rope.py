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
