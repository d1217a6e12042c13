"""Mirrors: a request that reads its shared segments from the round's Master.

After a round's reuse, a request's cache is not a dense copy. Its shared segments stay
where their base KV lives (the segment cache's blocks: the round's Master, shared by
every request of the round, one reference each); the request owns private slots only
for its own tokens (history, the last prompt token, generated tokens) and for the
reused tokens it recomputed (the patches). Attention reads it through slot-position
tables (kernels/paged_attention.py): its own blocks, then each segment's Master blocks
at the segment's offset in this prompt, with the patched tokens' Master copies hidden.

Which copy of a reused token a layer reads depends on the layer, so there are two views:
- early (layers before the check layer): with check layer 1 that is layer 0, whose K/V
  are context-free (a function of the token alone, keys before RoPE), so the Master's
  copy is exact and nothing is private; with a later check layer, layers 1 .. c-1 are
  recomputed for every token, so every reused token has a private slot there.
- late (the check layer and after): the Master's copy, except for the tokens selected
  for recomputation, which read their private patch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokendance.backend.keys import Key
from tokendance.backend.pool import flat_slots

EARLY, LATE = 0, 1


@dataclass(slots=True)
class Span:
    blocks: list[int]  # the Master's blocks holding this segment from slot 0
    lo: int  # position of the segment's first token in the prompt
    n: int
    key: Key = b""  # the segment cache's key: where an idle agent finds its Master again
    source: str = ""  # which base it read ("standalone", "producer", ...)
    version: int = 0  # which K/V under key it read (segments.Entry.version)


def ranges(starts: list[int], counts: list[int]) -> torch.Tensor:
    """starts[i] .. starts[i] + counts[i] - 1 for every i, concatenated (long). One
    arange per range: torch.repeat_interleave took 0.5-7 ms a call on the H200's host."""
    parts = [torch.arange(a, a + n) for a, n in zip(starts, counts)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass(slots=True, eq=False)
class Mirror:
    """Tensors on the host: a round builds and reads one per request while the
    GPU waits, so nothing here loops over tokens in Python."""

    prompt_len: int
    spans: list[Span]
    # Per private slot of the prompt area, per view: the token's position, -1 if that
    # view does not read this slot. Generated tokens follow the prompt area.
    own_pos: tuple[torch.Tensor, torch.Tensor]
    own_of: torch.Tensor  # per prompt token: its private slot, -1 if it has none
    reused: torch.Tensor  # per prompt token (bool): its base K/V is in one of the spans
    master_blocks: list[int] = field(default_factory=list)  # every span's, in order
    patch_free: list[int] = field(default_factory=list)  # unused patch slots (check layer 1)
    _fixed: dict = field(default_factory=dict)  # tensors derived from the above

    @classmethod
    def build(cls, prompt_len: int, spans: list[Span], reused: list[bool], dense_early: bool,
              patch_cap: int) -> Mirror:
        """Private slots for the tokens not reused; for every reused token too when
        dense_early (check layer > 1), else `patch_cap` spare slots for patches."""
        r = torch.tensor(reused, dtype=torch.bool)
        early = torch.nonzero(torch.ones_like(r) if dense_early else ~r).flatten()
        own_of = torch.full((prompt_len,), -1, dtype=torch.long)
        own_of[early] = torch.arange(len(early))
        late = torch.where(r[early], -1, early)
        free: list[int] = []
        if not dense_early:
            free = list(range(len(early) + patch_cap - 1, len(early) - 1, -1))  # pick() takes from the end
            room = torch.full((patch_cap,), -1, dtype=torch.long)
            early, late = torch.cat([early, room]), torch.cat([late, room])
        return cls(prompt_len, spans, (early, late), own_of, r, [b for sp in spans for b in sp.blocks],
                   patch_free=free)

    # -- writes --------------------------------------------------------------------

    def pick(self, tokens: list[int]) -> None:
        """Reused tokens (distinct) recomputed from the check layer on: they get a private
        patch, the lowest free slot first, in the given order."""
        if not tokens:
            return
        j = torch.tensor(tokens, dtype=torch.long)
        new = j[self.own_of[j] < 0]
        if len(new):
            self.own_of[new] = torch.tensor(self.room(len(new)), dtype=torch.long)
            del self.patch_free[len(self.patch_free) - len(new):]
        self.own_pos[LATE][self.own_of[j]] = j
        self._fixed.clear()

    def room(self, n: int) -> list[int]:
        """The private slots the next n new patches get, in `pick` order."""
        if n > len(self.patch_free):
            raise ValueError(f"{n} patches picked, room for {len(self.patch_free)}")
        return self.patch_free[len(self.patch_free) - n:][::-1]

    def trim(self) -> int:
        """Drop the patch room selection left unused (with a deviation floor, fewer
        tokens than the cap); returns the slots dropped. Patches take the lowest free
        slots, so the unused ones end the prompt area; call before any generated token
        has a slot (they follow the area)."""
        n = len(self.patch_free)
        if not n:
            return 0
        area = self.area
        assert sorted(self.patch_free) == list(range(area - n, area)), "unused patch room must end the area"
        self.own_pos = (self.own_pos[EARLY][: area - n], self.own_pos[LATE][: area - n])
        self.patch_free.clear()
        self._fixed.clear()
        return n

    def own_slot(self, j: int, view: int) -> int:
        """Private slot index where token j's K/V for this view goes, -1 for nowhere
        (the view reads the Master's copy)."""
        if j >= self.prompt_len:
            return self.area + j - self.prompt_len
        i = int(self.own_of[j])
        return i if i >= 0 and int(self.own_pos[view][i]) >= 0 else -1

    def own_index(self, view: int, rows: torch.Tensor) -> torch.Tensor:
        """`own_slot` of each token in rows (ascending), as a tensor."""
        head = self._own_head(view)
        tail = self.area + rows - self.prompt_len
        return torch.where(rows < self.prompt_len, head[rows.clamp_max(self.prompt_len - 1)], tail)

    def _own_head(self, view: int) -> torch.Tensor:
        """`own_slot` of every prompt token."""
        key = ("own", view)
        if key not in self._fixed:
            pos = torch.cat([self.own_pos[view], torch.tensor([-1])])  # of = -1 reads that last -1
            self._fixed[key] = torch.where(pos[self.own_of] >= 0, self.own_of, -1)
        return self._fixed[key]

    def _geometry(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt position of every span token, its slot in the spans' blocks laid end
        to end), in span order."""
        key = ("geometry", block_size)
        if key not in self._fixed:
            n = [sp.n for sp in self.spans]
            first = [0]
            for sp in self.spans[:-1]:
                first.append(first[-1] + len(sp.blocks) * block_size)
            self._fixed[key] = (ranges([sp.lo for sp in self.spans], n), ranges(first, n))
        return self._fixed[key]

    def master_slots(self, block_size: int) -> torch.Tensor:
        """Flat pool slot of each prompt token's base K/V in the Master (-1: none)."""
        if "master" not in self._fixed:
            tok, at = self._geometry(block_size)
            out = torch.full((self.prompt_len,), -1, dtype=torch.long)
            if len(tok):
                out[tok] = torch.where(self.reused[tok], flat_slots(self.master_blocks, at, block_size), -1)
            self._fixed["master"] = out
        return self._fixed["master"]

    # -- sizes ---------------------------------------------------------------------

    @property
    def area(self) -> int:
        """Private slots of the prompt (own tokens and patch room)."""
        return len(self.own_pos[EARLY])

    def own_slots(self, tokens: int) -> int:
        """Private slots needed once the sequence has `tokens` tokens."""
        return self.area + max(0, tokens - self.prompt_len)

    def held(self, tokens: int) -> int:
        """Private slots in use (unused patch room not counted)."""
        return self.own_slots(tokens) - len(self.patch_free)

    # -- reads ---------------------------------------------------------------------

    def table(self, view: int, own_blocks: list[int], block_size: int,
              master: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(block table, position of every slot of it) for attention in this view, int32:
        the own blocks, then (with `master`) the Master's."""
        key = ("table", view, len(own_blocks), master)  # changes only when a block is added
        if key not in self._fixed:
            head, spans = self._view(view, block_size)
            assert len(own_blocks) * block_size >= len(head), "own blocks must cover the prompt area"
            tail = torch.arange(self.prompt_len, self.prompt_len + len(own_blocks) * block_size - len(head),
                                dtype=torch.int32)
            self._fixed.pop(("table", view, len(own_blocks) - 1, master), None)
            blocks = own_blocks + self.master_blocks if master else own_blocks
            pos = (head, tail, spans) if master else (head, tail)
            self._fixed[key] = (torch.tensor(blocks, dtype=torch.int32), torch.cat(pos))
        return self._fixed[key]

    def master_cols(self, own_blocks: int, block_size: int) -> torch.Tensor:
        """Per prompt token: the column of `table`'s slots (with the Master, over
        `own_blocks` own blocks) where its Master copy sits, -1 if it has none."""
        tok, at = self._geometry(block_size)
        out = torch.full((self.prompt_len,), -1, dtype=torch.long)
        out[tok] = torch.where(self.reused[tok], own_blocks * block_size + at, -1)
        return out

    def master_pos(self, view: int, block_size: int) -> torch.Tensor:
        """Position at which this view reads each slot of its spans' blocks (in span
        order), -1 where it does not (a patch, the last prompt token, past the end)."""
        return self._view(view, block_size)[1]

    def _view(self, view: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if view not in self._fixed:
            self._fixed[view] = self._positions(view, block_size)
        return self._fixed[view]

    def _positions(self, view: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of the prompt area's slots, and of the Master slots (a segment's
        token is read there unless this view has a private copy of it)."""
        head = self._own_head(view)  # a span's tokens that are not reused are private: >= 0
        tok, at = self._geometry(block_size)
        spans = torch.full((len(self.master_blocks) * block_size,), -1, dtype=torch.int32)
        spans[at] = torch.where(head[tok] < 0, tok, -1).to(torch.int32)
        return self.own_pos[view].to(torch.int32), spans
