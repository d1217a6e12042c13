"""Attention tables of one view for a batch: where each computed token's K/V goes, and
which slots (at which positions) each sequence reads.

Two shapes for Mirrors (backend/mirror.py). In a prefill, each Mirror reads one table:
its own blocks, then the Master's, with a position per slot. In a decode step the
Master is read collectively (kernels/collective.py): each Mirror's table holds only its
own blocks, and the batch's Master, every segment any Mirror reads once, is described
by one `MasterRead`: where each segment sits in each Mirror's prompt and which of its
slots each Mirror hides.
"""

from __future__ import annotations

import torch

from tokendance.backend.mirror import Span, ranges
from tokendance.backend.sequence import Sequence
from tokendance.backend.upload import upload
from tokendance.kernels.master import NOT_READ, MasterRead, plan_chunks

# About this many chunks of the Master per decode step (each costs a query rotation;
# on an H200 at 10-20 Mirrors of a 2k-token round one chunk a segment did best).
CHUNKS = 16
ALIGN = 32  # chunk length granularity: the collective kernel's key tile on a GPU


def kv_view(seqs: list[Sequence], rows: list[torch.Tensor], view: int, block_size: int,
            trash: int, device: torch.device, collective: bool = False,
            chunk_cap: int | None = None, reads: bool = True) -> dict:
    """AttnMeta's store slots, block tables and key counts for computing token rows[i]
    (ascending) of seqs[i] in a view; with any Mirror among them, slot positions too,
    and with `collective` (a decode step) the Master apart, as `master` (see
    `master_read` for chunk_cap). Without `reads` (attention over the step's own K/V
    only) the store slots alone, and empty tables."""
    slots = torch.cat([seq.slots(r, view, block_size, trash) for seq, r in zip(seqs, rows)])
    if not reads:
        return dict(slots=upload(slots, device),
                    block_tables=torch.zeros(len(seqs), 0, dtype=torch.int32, device=device),
                    kv_lens=torch.zeros(len(seqs), dtype=torch.int32, device=device))
    collective = collective and any(s.mirror is not None for s in seqs)
    out = dict(slots=slots, **read_tables(seqs, [int(r[-1]) + 1 for r in rows], view, block_size,
                                          master=not collective))
    out = {k: upload(v, device) for k, v in out.items()}
    if collective:
        out["master"] = to_device(master_read(seqs, view, block_size, cap=chunk_cap), device)
    return out


def read_tables(seqs: list[Sequence], ends: list[int], view: int, block_size: int,
                master: bool = True) -> dict:
    """Block tables and key counts of seqs in a view (host tensors); with any Mirror
    among them, slot positions too. ends[i]: keys of a sequence without a Mirror (a
    Mirror reads its whole table); `master`: a Mirror's table holds the Master's blocks
    after its own (without: they are read collectively)."""
    mirrors = any(s.mirror is not None for s in seqs)
    tables, lens, spos = [], [], []
    for seq, end in zip(seqs, ends):
        if seq.mirror is None:
            tables.append(torch.tensor(seq.blocks, dtype=torch.int32))
            lens.append(end)
            if mirrors:
                spos.append(torch.arange(len(seq.blocks) * block_size, dtype=torch.int32))
        else:
            blocks, p = seq.mirror.table(view, seq.blocks, block_size, master=master)
            tables.append(blocks)
            lens.append(len(blocks) * block_size)
            spos.append(p)
    width = max(len(b) for b in tables)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, b in enumerate(tables):
        table[i, :len(b)] = b
    out = dict(block_tables=table, kv_lens=torch.tensor(lens, dtype=torch.int32))
    if mirrors:
        sp = torch.full((len(seqs), width * block_size), -1, dtype=torch.int32)
        for i, p in enumerate(spos):
            sp[i, :len(p)] = p
        out["slot_pos"] = sp
    return out


def segments(seqs: list[Sequence]) -> dict[tuple[int, int], Span]:
    """The batch's Master: every (segment, occurrence) a Mirror reads, first come first,
    with a Span of it (any Mirror's: they agree on blocks and length)."""
    seen: dict[tuple[int, int], Span] = {}
    for seq in seqs:
        if seq.mirror is not None:
            for key, sp in zip(_keys(seq), seq.mirror.spans):
                seen.setdefault(key, sp)
    return seen


def _keys(seq: Sequence) -> list[tuple[int, int]]:
    """A key per span of seq's Mirror: its first block (a block belongs to one segment
    base at a time), and how often that segment came before in this prompt (a segment
    that occurs twice in one prompt is read at two offsets)."""
    count: dict[int, int] = {}
    out = []
    for sp in seq.mirror.spans:
        b = sp.blocks[0]
        out.append((b, count.get(b, 0)))
        count[b] = count.get(b, 0) + 1
    return out


def master_read(seqs: list[Sequence], view: int, block_size: int, chunks: int = CHUNKS,
                cap: int | None = None) -> MasterRead:
    """The batch's Master in this view, on the host; `cap` pads the chunk list to that
    many (CUDA graphs want fixed shapes; the caller checks it suffices)."""
    segs = segments(seqs)
    index = {key: i for i, key in enumerate(segs)}
    starts, lens, blocks = [], [], []
    for sp in segs.values():
        starts.append(len(blocks) * block_size)
        lens.append(sp.n)
        blocks += sp.blocks
    plan = plan_chunks(lens, block_size, chunks if cap is None else max(1, min(chunks, cap - len(segs))),
                       ALIGN)
    n_chunks = len(plan) if cap is None else cap
    assert len(plan) <= n_chunks, "more chunks than the cap"
    seg_of = {base: i for i, base in enumerate(starts)}
    chunk_seg = torch.tensor([seg_of[base] for _, _, base in plan], dtype=torch.long)
    plan += [(0, 0, 0)] * (n_chunks - len(plan))
    # Per (sequence, segment): its offset in that prompt; per (sequence, Master slot):
    # hidden or not. Gathered in lists, written in two index_puts (a loop of small
    # tensor writes costs ~15 us each: 30 ms for 32 Mirrors of 32 segments).
    seg_lo = torch.full((len(seqs), len(segs)), NOT_READ, dtype=torch.int32)
    rows, cols, los, places, hidden = [], [], [], [], []
    for s, seq in enumerate(seqs):
        if seq.mirror is None or not seq.mirror.spans:
            continue
        ks = [index[key] for key in _keys(seq)]
        rows += [s] * len(ks)
        cols += ks
        los += [sp.lo for sp in seq.mirror.spans]
        base = s * len(blocks) * block_size  # this sequence's row of `hide`
        places.append(ranges([starts[k] + base for k in ks],
                             [len(sp.blocks) * block_size for sp in seq.mirror.spans]))
        hidden.append(seq.mirror.master_pos(view, block_size) < 0)
    if rows:
        seg_lo[rows, cols] = torch.tensor(los, dtype=torch.int32)
    hide = torch.zeros(len(seqs) * len(blocks) * block_size, dtype=torch.uint8)
    if places:
        hide[torch.cat(places)] = torch.cat(hidden).to(torch.uint8)
    shift = torch.full((len(seqs), n_chunks), NOT_READ, dtype=torch.int32)
    shift[:, : len(chunk_seg)] = seg_lo[:, chunk_seg]
    return MasterRead(torch.tensor(blocks, dtype=torch.int32),
                      torch.tensor(plan, dtype=torch.int32).view(-1, 3), shift,
                      hide.view(len(seqs), len(blocks) * block_size))


def to_device(read: MasterRead, device: torch.device) -> MasterRead:
    return MasterRead(*(upload(t, device) for t in (read.table, read.chunks, read.shift, read.hide)))
