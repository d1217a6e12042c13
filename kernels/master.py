"""The Master a decode batch reads collectively: its description (MasterRead) and how
its segments are cut into chunks, the collective kernel's unit of work
(kernels/collective.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NOT_READ = 1 << 30  # a shift that puts a chunk past every query: the Mirror does not read it


@dataclass(slots=True)
class MasterRead:
    """The Master keys of a decode batch, read collectively. Master slot i lives in
    pool block table[i // B] at offset i % B; chunk c covers slots [lo, hi) of the
    segment whose slot 0 is `base` (chunks[c] = lo, hi, base); Mirror s reads segment
    slot t at position shift[s, c] + t unless hide[s, base + t] is nonzero."""

    table: torch.Tensor  # [blocks] int32
    chunks: torch.Tensor  # [C, 3] int32
    shift: torch.Tensor  # [S, C] int32
    hide: torch.Tensor  # [S, L] uint8 or bool, L >= every chunk's hi


def plan_chunks(lens: list[int], block_size: int, target: int, align: int) -> list[tuple[int, int, int]]:
    """(lo, hi, base) chunks of segments of `lens` tokens laid out block-aligned one after
    the other: about `target` chunks in all, each a multiple of `align` slots (a tile)."""
    total = sum(lens)
    if not total:
        return []
    piece = max(align, -(-max(1, -(-total // max(1, target))) // align) * align)
    out, base = [], 0
    for n in lens:
        out += [(lo, min(lo + piece, base + n), base) for lo in range(base, base + n, piece)]
        base += -(-n // block_size) * block_size
    return out


def one_segment(shift: torch.Tensor, master_table: torch.Tensor, master_len: int,
                hide: torch.Tensor, n: int, align: int) -> MasterRead:
    """The Master as one segment of master_len slots at shift[s] in Mirror s, cut into n
    equal chunks of a multiple of `align` slots (some maybe empty); built on shift's
    device (no host copy: CUDA graphs can capture it)."""
    span = -(-max(1, -(-master_len // n)) // align) * align
    lo = torch.arange(n, device=shift.device, dtype=torch.int32) * span
    chunks = torch.stack((lo.clamp_max(master_len), (lo + span).clamp_max(master_len), lo * 0), 1)
    return MasterRead(master_table, chunks.contiguous(),
                      shift.to(torch.int32)[:, None].expand(-1, n).contiguous(), hide)


def check_segment(q, q_pos, shift, k_cache, v_cache, master_table, master_len, hide, inv_freq) -> None:
    """ValueError on inconsistent arguments of a collective attention over one segment
    (kernels/collective.py: both implementations check them)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [S, Hq, D], got {tuple(q.shape)}")
    S, Hq, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, B, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _, B, Hkv, Dk = k_cache.shape
    if Dk != D or Hq % Hkv:
        raise ValueError(f"q heads/dim {Hq}/{D} do not fit the pool's {Hkv}/{Dk}")
    if tuple(q_pos.shape) != (S,) or tuple(shift.shape) != (S,):
        raise ValueError(f"q_pos {tuple(q_pos.shape)} and shift {tuple(shift.shape)} must be [{S}]")
    if master_len < 0 or master_table.dim() != 1 or master_table.numel() * B < master_len:
        raise ValueError(f"master_table of {tuple(master_table.shape)} blocks of {B} cannot "
                         f"hold master_len={master_len}")
    if (hide.dtype != torch.bool or hide.dim() != 2 or hide.shape[0] != S
            or hide.shape[1] < master_len):
        raise ValueError(f"hide must be bool [{S}, >= {master_len}], got {hide.dtype} "
                         f"{tuple(hide.shape)}")
    if tuple(inv_freq.shape) != (D // 2,):
        raise ValueError(f"inv_freq must be [{D // 2}], got {tuple(inv_freq.shape)}")
