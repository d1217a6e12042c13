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
