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
