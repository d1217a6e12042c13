"""A blend's late view, built on the device from the check layer's picks.

From its check layer on, a blend computes only the rows that carry forward: each
prompt's own tokens and the reused tokens its check layer selected (backend/blend.py).
Which tokens were selected is known on the device. Reading it back before the later
layers are queued left the GPU idle while the host built their metadata. How many each
prompt selects is known before (the cap, ceil(r * reused tokens); with a deviation
floor the caller reads the counts back), so the host plans everything else while the
GPU computes (`plan`), and a few device ops put the picks in (`Plan.meta`):
- the kept rows of each prompt in position order, with their store slots: a pick's
  patch slot is the next slot of its Mirror's patch room (check layer 1), or its own
  slot (a later check layer, where every token has one);
- the Mirrors' slot positions: each patch slot gets its token's position, and each
  pick's Master copy is hidden.
That is what `tables.kv_view` gives for those rows once `Mirror.pick` has run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokendance.backend.mirror import LATE
from tokendance.backend.model import AttnMeta
from tokendance.backend.sequence import Sequence
from tokendance.backend.tables import read_tables
from tokendance.backend.upload import upload

LAST = torch.iinfo(torch.long).max  # sorts after every position


@dataclass(slots=True)
class Plan:
    """What the late view needs besides the picks; tensors on the device."""

    own: list[int]  # per prompt: its own rows (not reused), the picks come on top
    room: torch.Tensor  # [n, r] patch room slots in pick order, 0-padded
    own_pos: torch.Tensor  # [n, w] own rows' positions, LAST-padded
    own_slots: torch.Tensor  # [n, w] their store slots
    own_rows: torch.Tensor  # [n, w] their rows in the step
    row0: torch.Tensor  # [n, 1] a prompt's position = its step row - row0
    own_of: torch.Tensor  # [step rows] the row's own slot index (-1: none)
    master_col: torch.Tensor  # [step rows] slot_pos column of its Master copy (-1: none)
    reads: dict  # block_tables, kv_lens, slot_pos (before any pick)
    block_size: int

    def meta(self, picks: torch.Tensor, counts: list[int]) -> tuple[AttnMeta, torch.Tensor]:
        """(the late view's AttnMeta, the kept rows' indices in the step) for picks
        [n, k] (step rows, ascending, -1-padded), `counts[i]` of them valid in row i."""
        n, k = picks.shape
        dev = picks.device
        valid = picks >= 0
        rows = picks.clamp_min(0)
        pos = rows - self.row0
        room = torch.nn.functional.pad(self.room[:, :k], (0, max(0, k - self.room.shape[1])))
        has = self.own_of[rows]  # a later check layer: the pick's own slot
        slot = torch.where(has >= 0, has, room).masked_fill(~valid, 0)  # into own blocks
        bsz = self.block_size
        tables = self.reads["block_tables"]
        pool = tables.gather(1, slot // bsz).long() * bsz + slot % bsz
        # Kept rows: own rows and picks, merged in position order.
        keys = torch.cat([self.own_pos, torch.where(valid, pos, LAST)], 1)
        order = keys.argsort(1)
        width = keys.shape[1]
        cu = [0]
        take = []
        for i, (o, c) in enumerate(zip(self.own, counts)):
            take.append(torch.arange(i * width, i * width + o + c))
            cu.append(cu[-1] + o + c)
        take = upload(torch.cat(take), dev)

        def pick_rows(t: torch.Tensor) -> torch.Tensor:
            return t.gather(1, order).flatten()[take]

        reads = dict(self.reads)
        if "slot_pos" in reads:  # patches become visible, their Master copies hidden
            sp = reads["slot_pos"]
            cols = sp.shape[1]
            flat = torch.cat([sp.flatten(), sp.new_zeros(1)])  # the last element takes misses
            sink = flat.numel() - 1
            base = torch.arange(n, device=dev)[:, None] * cols
            flat[torch.where(valid, base + slot, sink)] = pos.to(flat.dtype)
            hide = self.master_col[rows]
            flat[torch.where(valid & (hide >= 0), base + hide, sink)] = -1
            reads["slot_pos"] = flat[:sink].view(n, cols)
        meta = AttnMeta(positions=pick_rows(keys), slots=pick_rows(torch.cat([self.own_slots, pool], 1)),
                        cu_q=upload(torch.tensor(cu, dtype=torch.int32), dev),
                        max_q=max(a - b for a, b in zip(cu[1:], cu)), **reads)
        return meta, pick_rows(torch.cat([self.own_rows, rows], 1))


def plan(seqs: list[Sequence], reused: list[torch.Tensor], starts: list[int], offsets: list[int],
         block_size: int, trash: int, device: torch.device) -> Plan:
    """The late view's plan for prompts seqs[i] computed from starts[i] on, rows
    offsets[i] .. offsets[i+1] of the step; reused[i] (bool, per prompt token) marks
    the tokens the check layer may pick."""
    own, room, pos, slots, steps, own_of, cols = [], [], [], [], [], [], []
    reads = read_tables(seqs, [len(s.prompt) for s in seqs], LATE, block_size)
    for seq, r, start, off in zip(seqs, reused, starts, offsets):
        assert not r[-1], "a prompt's last token is always computed: it samples"
        mine = torch.nonzero(~r[start:]).flatten() + start
        own.append(len(mine))
        pos.append(mine)
        slots.append(seq.slots(mine, LATE, block_size, trash))
        steps.append(mine - start + off)
        m = seq.mirror
        n = len(seq.prompt) - start
        if m is None:
            room.append(torch.zeros(0, dtype=torch.long))
            own_of.append(torch.full((n,), -1, dtype=torch.long))
            cols.append(torch.full((n,), -1, dtype=torch.long))
            continue
        room.append(torch.tensor(m.room(len(m.patch_free)), dtype=torch.long))
        own_of.append(m.own_of[start:])
        cols.append(m.master_cols(len(seq.blocks), block_size)[start:])

    def pad(ts: list[torch.Tensor], value: int) -> torch.Tensor:
        w = max(len(t) for t in ts)
        return torch.stack([torch.cat([t, t.new_full((w - len(t),), value)]) for t in ts])

    return Plan(own, upload(pad(room, 0), device), upload(pad(pos, LAST), device),
                upload(pad(slots, trash), device), upload(pad(steps, 0), device),
                upload(torch.tensor([[off - start] for off, start in zip(offsets, starts)]), device),
                upload(torch.cat(own_of), device), upload(torch.cat(cols), device),
                {k: upload(v, device) for k, v in reads.items()}, block_size)
