"""Attention tables of one view for a batch: where each computed token's K/V goes, and
which slots (at which positions) each sequence reads."""

from __future__ import annotations

import torch

from tokendance.backend.sequence import Sequence


def kv_view(seqs: list[Sequence], rows: list[torch.Tensor], view: int, block_size: int,
            trash: int, device: torch.device) -> dict:
    """AttnMeta's store slots, block tables and key counts for computing token rows[i]
    (ascending) of seqs[i] in a view; with any Mirror among them, slot positions too."""
    mirrors = any(s.mirror is not None for s in seqs)
    slots, tables, lens, spos = [], [], [], []
    for seq, r in zip(seqs, rows):
        slots.append(seq.slots(r, view, block_size, trash))
        if seq.mirror is None:
            tables.append(torch.tensor(seq.blocks, dtype=torch.int32))
            lens.append(int(r[-1]) + 1)
            if mirrors:
                spos.append(torch.arange(len(seq.blocks) * block_size, dtype=torch.int32))
        else:
            blocks, p = seq.mirror.table(view, seq.blocks, block_size)
            tables.append(blocks)
            lens.append(len(blocks) * block_size)
            spos.append(p)
    width = max(len(b) for b in tables)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, b in enumerate(tables):
        table[i, :len(b)] = b
    out = dict(slots=torch.cat(slots), block_tables=table,
               kv_lens=torch.tensor(lens, dtype=torch.int32))
    if mirrors:
        sp = torch.full((len(seqs), width * block_size), -1, dtype=torch.int32)
        for i, p in enumerate(spos):
            sp[i, :len(p)] = p
        out["slot_pos"] = sp
    return {k: v.to(device, non_blocking=True) for k, v in out.items()}
