"""Inverse frequencies of RoPE for the scaling kinds our model families use.

Returns (inv_freq [D/2] float32, attention_scaling): attention kernels compute
cos/sin(pos * inv_freq) * attention_scaling themselves, from each token's position.
"""

from __future__ import annotations

import math

import torch

from tokendance.backend.api import InvalidRequest
from tokendance.backend.config import ModelConfig


def _base(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv: torch.Tensor, p: dict) -> torch.Tensor:
    factor = p["factor"]
    low, high = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    orig = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (orig / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > orig / low, inv / factor, inv)
    is_mid = (wavelen <= orig / low) & (wavelen >= orig / high)
    return torch.where(is_mid, mid, out)


def _yarn(theta: float, dim: int, p: dict, max_position: int) -> tuple[torch.Tensor, float]:
    orig = p.get("original_max_position_embeddings") or max_position
    factor = p.get("factor") or max_position / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def dim_of(rot: float) -> float:  # dimension whose wavelength makes `rot` turns
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(p.get("beta_fast", 32)), dim_of(p.get("beta_slow", 1))
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extra = 1.0 - ramp  # 1: keep the original frequency, 0: interpolate
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(attn)


def _longrope(theta: float, dim: int, p: dict, max_position: int, long: bool) -> tuple[torch.Tensor, float]:
    """Phi-3's: its long factors or its short ones (ModelConfig.reach chooses), either with
    the same attention factor."""
    orig = p.get("original_max_position_embeddings")
    if not isinstance(orig, int) or orig < 1:
        raise InvalidRequest("longrope needs original_max_position_embeddings", "model")
    name = "long_factor" if long else "short_factor"
    factors = p.get(name)
    if not isinstance(factors, list) or len(factors) != dim // 2:
        raise InvalidRequest(f"longrope needs {dim // 2} {name} values (one a rotated pair)", "model")
    attn = p.get("attention_factor")
    if attn is None:
        factor = p.get("factor") or max_position / orig
        attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return _base(theta, dim) / torch.tensor(factors, dtype=torch.float32), float(attn)


def rope_params(rope: dict, head_dim: int, max_position: int, long: bool = False) -> tuple[torch.Tensor, float]:
    kind, theta = rope.get("rope_type", "default"), float(rope["rope_theta"])
    if kind == "default":
        return _base(theta, head_dim), 1.0
    if kind == "linear":
        return _base(theta, head_dim) / rope["factor"], 1.0
    if kind == "llama3":
        return _llama3(_base(theta, head_dim), rope), 1.0
    if kind == "yarn":
        return _yarn(theta, head_dim, rope, max_position)
    if kind == "longrope":
        return _longrope(theta, head_dim, rope, max_position, long)
    raise InvalidRequest(
        f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3, yarn, longrope",
        "model",
    )


def rotary(cfg: ModelConfig) -> tuple[torch.Tensor, float, float]:
    """The model's RoPE as the kernels take it: inv_freq [head_dim / 2], the scale they put
    on cos and sin, and a factor the loader folds into q's and k's rotated rows instead.
    A model that rotates only its first rotary_dim dims gets zero frequencies for the
    other pairs (backend/loader.py pairs its dims up so); its attention scaling is folded,
    since the kernels' scale would reach the unrotated pairs too."""
    dim = cfg.rotary_dim or cfg.head_dim
    inv_freq, scale = rope_params(cfg.rope, dim, cfg.max_position, cfg.long_rope)
    if dim == cfg.head_dim:
        return inv_freq, scale, 1.0
    return torch.cat([inv_freq, inv_freq.new_zeros((cfg.head_dim - dim) // 2)]), 1.0, scale
