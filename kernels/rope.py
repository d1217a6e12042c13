"""Rotary position embedding, applied on read.

Keys live in the KV pool un-rotated; attention rotates them from each token's logical
position, so one stored block can serve any sequence at any offset. The convention is
the "rotate half" one of Llama / Qwen2 / Mistral checkpoints: the head dimension is
split in two halves (x1, x2) that rotate as the real and imaginary parts of D/2
complex numbers.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    pos: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [len(pos), D/2], in float32."""
    freqs = pos.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    return freqs.cos() * scale, freqs.sin() * scale


def rope_rotate(
    x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """Rotate x [T, H, D] by positions pos [T]; math in float32, result in x.dtype."""
    cos, sin = rope_cos_sin(pos, inv_freq, scale)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
