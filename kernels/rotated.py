"""CPU decode over keys kept rotated: each layer holds the decode batch's keys, rotated
at their positions, and its values, heads-first, from one step to the next.

The pool stores keys before RoPE, so `_decode_reference` (paged_attention.py) gathers
and rotates every key of every sequence at every step and layer. On 2 cores (SmolLM2,
8 sequences of 256 keys, float32) that gather and rotation took 0.33 ms of a layer's
0.65-0.73 ms of attention; HF's SDPA over its cache of rotated keys takes 0.13-0.16 ms,
and appending to that cache 0.13. Here a layer keeps what the last decode step
gathered: while the batch is the same sequences, each one query further on, a step
only rotates and appends the one new key of each sequence (its pool slot: the step's
store slot) and runs one SDPA call over the held keys. Anything else (another batch, a
sequence that moved more than one token, the held columns full) gathers again. In the
engine a decode step then takes 0.79 of the time at batch 8 (63 against 80 ms), 0.89
at batch 1 (34 against 38 ms). The cost is memory: a dense float32 copy of the batch's
K/V per layer, as an HF cache holds, within a byte budget for all layers (past it,
decode gathers per step as before)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokendance.kernels.rope import rope_apply, rope_cos_sin
from tokendance.kernels.softcap import sdpa

SPARE = 64  # columns held beyond a gather's keys: steps before the next gather


@dataclass(slots=True)
class _Held:
    rows: tuple  # the batch's sequences (any objects, compared by identity)
    qpos: list[int]  # each row's query position at the last step
    n: int  # columns in use (a row's padding and hidden keys among them, masked)
    k: torch.Tensor  # [S, Hkv, cap, D] float32, rotated
    v: torch.Tensor  # [S, Hkv, cap, D] float32
    mask: torch.Tensor  # [S, cap] additive: 0 for a key the row sees, -inf elsewhere
    pos: torch.Tensor  # [S, cap] the keys' positions (a sliding window's mask moves with them)


class RotatedKeys:
    """The held keys of every layer (keyed by the layer's K pool), for one engine."""

    def __init__(self, budget: int, layers: int):
        self.budget, self.layers = budget, layers  # bytes for all layers together
        self.held: dict[int, _Held] = {}

    def clear(self) -> None:
        self.held.clear()

    def fits(self, s: int, hkv: int, cap: int, d: int) -> bool:
        return 2 * s * hkv * cap * d * 4 * self.layers <= self.budget


@dataclass(slots=True)
class RotatedStep:
    """One decode step's part: its rows (one query each), their positions and the pool
    slots their new keys were stored at."""

    keys: RotatedKeys
    rows: tuple
    qpos: list[int]
    slots: torch.Tensor  # [S] flat pool slots
    # made by the step's first append, for every layer of the same RoPE (a NoPE layer's is another)
    rot: dict[int, torch.Tensor] = field(default_factory=dict)
    at: torch.Tensor = field(init=False)  # qpos as a tensor, made once for every layer

    def __post_init__(self) -> None:
        self.at = torch.tensor(self.qpos, device=self.slots.device)

    def rotation(self, inv_freq: torch.Tensor, rope_scale: float) -> torch.Tensor:
        """RoPE at the rows' positions as matrices [S, D, D] (k @ R rotates a row's keys
        [Hkv, D]): one batched matmul a layer instead of a handful of small ops."""
        r = self.rot.get(inv_freq.data_ptr())
        if r is None:
            cos, sin = rope_cos_sin(self.at, inv_freq, rope_scale)  # [S, D/2]
            s, half = cos.shape
            i = torch.arange(half)
            r = torch.zeros(s, 2 * half, 2 * half)
            r[:, i, i] = cos
            r[:, i + half, i + half] = cos
            r[:, i + half, i] = -sin
            r[:, i, i + half] = sin
            self.rot[inv_freq.data_ptr()] = r
        return r


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def rotated_decode(step: RotatedStep, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   layout, inv_freq: torch.Tensor, rope_scale: float, sm_scale: float,
                   window: int = 0, softcap: float = 0.0) -> torch.Tensor | None:
    """Decode attention [S, Hq, D] in q.dtype over the held keys of this layer, appending
    the step's new ones; None when they would not fit the budget (the caller gathers).
    layout(): `_decode_layout`'s tuple for this step, made only when gathering. In a
    sliding window of `window` keys the held keys that left a row's window are masked;
    scores capped at `softcap` (0: none)."""
    keys, s = step.keys, q.shape[0]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    h = keys.held.get(k_cache.data_ptr())
    moved = h is not None and _same(h.rows, step.rows) and all(
        p == o + 1 for p, o in zip(step.qpos, h.qpos))
    if moved and h.n < h.k.shape[2]:
        _append(h, step, k_cache, v_cache, inv_freq, rope_scale)
    else:
        keys.held.pop(k_cache.data_ptr(), None)  # the old batch's buffers go first
        h = _gather(step, k_cache, v_cache, layout())
        if h is None:
            return None
        keys.held[k_cache.data_ptr()] = h
    # The G query heads of a kv head as G query rows of one head: SDPA then needs no
    # GQA expansion of K/V (0.7x the time of enable_gqa on 2 cores).
    n = h.n
    mask = h.mask[:, :n]
    if window:
        mask = mask.masked_fill(h.pos[:, :n] <= (step.at - window)[:, None], float("-inf"))
    o = sdpa(q.float().view(s, hkv, -1, d), h.k[:, :, :n], h.v[:, :, :n], sm_scale, softcap,
             mask=mask[:, None, None, :])
    return o.reshape(q.shape).to(q.dtype)


def gathered(k_cache: torch.Tensor, v_cache: torch.Tensor, layout, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys, rotated in float32, and the values of `_decode_layout`'s gather for s
    sequences, both [S, L, Hkv, D]."""
    idx, width, cos, sin = layout[:4]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.flatten(0, 1).index_select(0, idx).view(s, width, hkv, d).float()
    v = v_cache.flatten(0, 1).index_select(0, idx).view(s, width, hkv, d)
    return rope_apply(k, cos, sin, inplace=True), v


def _gather(step: RotatedStep, k_cache, v_cache, layout) -> _Held | None:
    """Hold every key the step's rows see (`_decode_layout`'s gather, rotated)."""
    width, mask = layout[1], layout[4]
    s, hkv, d = len(step.rows), k_cache.shape[2], k_cache.shape[3]
    cap = width + SPARE
    if not step.keys.fits(s, hkv, cap, d):
        return None
    k = torch.empty(s, hkv, cap, d, dtype=torch.float32, device=k_cache.device)
    v = torch.empty_like(k)
    got_k, got_v = gathered(k_cache, v_cache, layout, s)
    k[:, :, :width] = got_k.transpose(1, 2)
    v[:, :, :width] = got_v.transpose(1, 2)
    held = torch.full((s, cap), float("-inf"), device=k.device)
    held[:, :width] = mask
    pos = torch.full((s, cap), -1, dtype=torch.long, device=k.device)
    pos[:, :width] = layout[5]
    return _Held(step.rows, list(step.qpos), width, k, v, held, pos)


def _append(h: _Held, step: RotatedStep, k_cache, v_cache, inv_freq, rope_scale: float) -> None:
    """Each row's new key (at its query position, stored at its step slot) into the next
    column."""
    k = k_cache.flatten(0, 1).index_select(0, step.slots).float()
    h.k[:, :, h.n] = torch.bmm(k, step.rotation(inv_freq, rope_scale))
    h.v[:, :, h.n] = v_cache.flatten(0, 1).index_select(0, step.slots)
    h.mask[:, h.n] = 0.0
    h.pos[:, h.n] = step.at
    h.n += 1
    h.qpos = step.qpos
