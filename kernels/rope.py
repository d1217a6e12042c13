"""Rotary position embedding, applied on read.

Keys live in the KV pool un-rotated; attention rotates them from each token's logical
position, so one stored block can serve any sequence at any offset. The convention is
the "rotate half" one of Llama / Qwen2 / Mistral checkpoints: the head dimension is
split in two halves (x1, x2) that rotate as the real and imaginary parts of D/2
complex numbers.
"""

from __future__ import annotations

import torch

# (inv_freq storage, layout, scale) -> (cos, sin, inv_freq) tables over positions
# 0..n-1. Every layer of every step rotates by the same positions: compute cos/sin once,
# then gather. An entry keeps its inv_freq alive, so no other tensor can take over that
# address while the entry exists (inv_freq must not be changed in place).
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_MAX_TABLES = 16


def _table(inv_freq: torch.Tensor, scale: float, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (inv_freq.data_ptr(), str(inv_freq.device), inv_freq.dtype, inv_freq.shape,
           inv_freq.stride(), scale)
    cached = _TABLES.get(key)
    if cached is None or cached[0].shape[0] < n:
        size = max(n, 2 * cached[0].shape[0] if cached else 4096)
        pos = torch.arange(size, device=inv_freq.device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.to(torch.float32)[None, :]
        cached = (freqs.cos() * scale, freqs.sin() * scale, inv_freq)
        _TABLES.pop(key, None)
        while len(_TABLES) >= _MAX_TABLES:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = cached
    return cached[0], cached[1]


def rope_cos_sin(
    pos: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [len(pos), D/2], in float32 (exactly cos/sin(pos * inv_freq) * scale)."""
    if pos.is_cuda or pos.numel() == 0:
        # On a GPU cos/sin are cheap, and a table would need the largest position on
        # the host: a device sync per call.
        freqs = pos.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
        return freqs.cos() * scale, freqs.sin() * scale
    cos, sin = _table(inv_freq, scale, int(pos.max()) + 1)
    idx = pos.to(device=cos.device, dtype=torch.long)
    return cos[idx], sin[idx]


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
