"""The `kvcomm` and `kvcmas` modes: shared segments read at their base KV plus an offset
predicted from anchors (backend/anchors.py), nothing of them recomputed past the check layer.

A group's requests each get a dense cache (no Mirror: every request's corrected K/V
is its own). A request whose every reused segment finds an offset gets base + offset
written at those tokens, from the check layer on, and its own tokens computed over
them: the layers before the check layer run for every token (exact, as in `pic`), the
later ones for its own tokens only (backend/blend.py with nothing selected). A request
with a segment that finds none is prefilled exactly, in the same batch, and each of its
segments' offsets becomes an anchor. The segments' bases are prefilled standalone once
per round, as `pic` does.

An agent's places: its j-th shared segment counted from the prompt's end (where each
round's newest segments sit, whether the prompt shows the last round only or grows by
the history), whose anchors are measured in exact prefills; and, per text, where it sat
counted from the start, which keeps the offset the text read there (measured or
predicted): when the agent's next prompt grows from this one, the same text at the
same place reads it again, exactly as the prompt before it is unchanged.

An agent's finished request is parked on the host like pic's (backend/idle.py, a plain
sequence): its next request restores the prefix they share, segments and its own
tokens alike, and computes and predicts only what follows (one that measures does so
over the prefix it restored). Where an exact prefill computed the restored prefix
(`Sequence.exact`: up to the first predicted segment), the segments it covers are
measured at their new places from the end: the one right after an agent's own answer
is restored each time it could be measured.

`kvcmas` is KVCMAS's correction ("Efficient KV cache Correction for Shared Context in
Multi-Agent Systems"): the same places and rule, its anchors held at a low rank
(backend/lowrank.py), and chained: a segment's base is the KV its producer computed for
it (its requests publish their outputs, as `--bases producer` does for every mode), so
an offset corrects only what the reader's context changes. Its places are its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokendance.backend.anchors import Anchors, Place
from tokendance.backend.batches import batches
from tokendance.backend.blend import BlendInput, blend
from tokendance.backend.keys import Key
from tokendance.backend.lowrank import LowRank, factor_all
from tokendance.backend.mirror import EARLY
from tokendance.backend.pool import flat_slots
from tokendance.backend.segments import Entry
from tokendance.backend.sequence import EXACT, Sequence
from tokendance.kernels.fp8 import narrow, widen

if TYPE_CHECKING:
    from tokendance.backend.collector import Collector

# Anchors a placeholder keeps: a simulation's round gives each one at most one exact
# measurement, and a context several rounds old has moved on (KVCOMM keeps up to 20).
PER_PLACE = 4

Found = tuple[int, int, int, Entry]  # (ordinal in the prompt, lo, hi, base entry)


class AnchorReuse:
    def __init__(self, col: "Collector", mode: str, rank: int):
        self.col, self.mode, self.rank = col, mode, rank
        self.anchors: Anchors = col.anchors
        self.predicted = 0  # requests whose segments read base + predicted offset
        self.measured = 0  # requests with reused segments prefilled exactly: they gave anchors

    def prefill(self, group: list[Sequence]) -> tuple[list[Sequence], torch.Tensor | None]:
        """Collector.prefill in its mode."""
        entered: list[Entry] = []
        try:
            return self._prefill(group, entered)
        except BaseException:
            for e in entered:
                self.col.segments.discard(e)
            raise

    def _flat(self) -> torch.Tensor:
        return self.col.cache.kv.flatten(2, 3)  # [layers, 2, slots, heads, dim]

    def _read(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the K/V at slots from the check layer on, in the model's dtype."""
        cache = self.col.cache
        return widen(self._flat()[self.col.cfg.check_layer:, :, slots.to(cache.kv.device)], cache.dtype)

    def _bases(self, found: list[Found]) -> torch.Tensor:
        """The found segments' base K/V side by side, in one gather."""
        b = self.col.cache.block_size
        return self._read(torch.cat([flat_slots(e.blocks, torch.arange(e.ntokens), b) for *_, e in found]))

    def _rows(self, seq: Sequence, found: list[Found]) -> torch.Tensor:
        """The found segments' slots in seq's own blocks, side by side."""
        rows = torch.cat([torch.arange(lo, hi) for _, lo, hi, _ in found])
        return seq.slots(rows, EARLY, self.col.cache.block_size, self.col.cache.trash)

    def _prefill(self, group: list[Sequence], entered: list[Entry]) -> tuple[list[Sequence], torch.Tensor | None]:
        col = self.col
        c = col.cfg.check_layer
        pinned: list[Entry] = []
        ready: list[Sequence] = []
        items: list[BlendInput] = []
        exact: list[tuple[Sequence, list[Found], torch.Tensor]] = []
        served: list[tuple[Sequence, list[Found], tuple[torch.Tensor, ...]]] = []  # offsets per segment
        try:
            keys: list[list[tuple[int, int, int, Key]]] = []  # per seq: (ordinal, lo, hi, key)
            covered: list[list[tuple[int, int, int, Key]]] = []  # restored as an exact prefill gave them
            missing: dict[Key, list[int]] = {}
            for seq in group:
                start = seq.resume.length if seq.resume is not None else 0
                spans = [(j, lo, hi, k) for j, ((lo, hi), k) in enumerate(zip(seq.shared, seq.segment_keys()))]
                keys.append([sp for sp in spans if sp[1] >= start])  # not restored
                covered.append([sp for sp in spans if seq.resume is not None and sp[2] <= seq.resume.exact])
                missing.update((k, seq.prompt[lo:hi]) for _, lo, hi, k in keys[-1]
                               if col.segments.get(k) is None)
            col.standalone(col.enter_bases(missing, pinned, entered))
            entries = col.pin([sp[-1] for spans in keys + covered for sp in spans], pinned)
            for seq, spans in zip(group, keys):
                if not col.reserve(seq, len(seq.prompt)):
                    break  # it waits for a later step, as do those after it
                found = [(j, lo, hi, entries[k]) for j, lo, hi, k in spans if k in entries]
                reused = [False] * len(seq.prompt)
                seq.exact = EXACT  # until a prediction, or a restored prefix that was not exact
                if seq.resume is not None and seq.resume.exact < seq.resume.length:
                    seq.exact = seq.resume.exact
                if found:
                    bases = self._bases(found)
                    offsets = self._predict(seq, found, bases)
                    if offsets is None:
                        exact.append((seq, found, bases))
                    else:
                        flat = self._flat()
                        flat[c:, :, self._rows(seq, found).to(flat.device)] = narrow(bases + offsets, flat.dtype)
                        for _, lo, hi, _ in found:
                            reused[lo:hi] = [True] * (hi - lo)
                        reused[-1] = False  # the last prompt token is always computed: it samples
                        seq.exact = min(seq.exact, found[0][1])
                        served.append((seq, found, offsets.split([hi - lo for _, lo, hi, _ in found], 2)))
                ready.append(seq)
                items.append(BlendInput(seq, reused, seq.resume.length if seq.resume is not None else 0))
            resumed = [(seq.resume, seq) for seq in ready if seq.resume is not None]
            if resumed:  # one fused restore for the group: plain prefixes, no Masters
                col.idle.restore(resumed, {})
            restored = self._restored(ready, covered, entries)
        finally:
            for e in pinned:
                col.segments.unpin(e)
            for seq in group:
                if seq not in ready:
                    col.idle.forgo(seq)  # a later step prefills it whole
        if not ready:
            return [], None
        subs = batches(items, lambda it: len(it.seq.prompt) - it.start, col.cfg.max_tokens,
                       remainder_first=True)
        parts = [blend(col.model, col.cache, sub, c, 0.0) for sub in subs]
        col.runner.work += sum(p.work for p in parts)
        self.measured += len(exact)
        self.predicted += len(served)
        new: list[tuple[Place, torch.Tensor, torch.Tensor | None, int | None]] = restored
        for seq, found, bases in exact:  # their K/V are exact now: measure each offset
            measured = self._measure(seq, found, bases)
            new += measured
            served.append((seq, found, tuple(o for _, o, _, _ in measured)))
        for seq, found, per_segment in served:  # what each text read where it sat, for its next time there
            for (j, _, _, e), o in zip(found, per_segment):
                new.append((self._place(seq, (j, e.key)), o, None, 1))
        self._keep(new)
        for seq, it in zip(ready, items):
            seq.cached, seq.recomputed = it.start + sum(it.reused[it.start:]), 0  # restored or predicted
            seq.computed = len(seq.prompt)
            seq.resume = None
        return ready, torch.cat([p.logits for p in parts])

    def _restored(self, ready: list[Sequence], covered: list[list[tuple[int, int, int, Key]]],
                  entries: dict[Key, Entry]) -> list[tuple[Place, torch.Tensor, torch.Tensor, None]]:
        """Anchors at the places a restored prefix covers, where an exact prefill computed
        it (read once restored): the segment right after an agent's own answer is
        restored whenever it is measured, and would otherwise never get one."""
        out = []
        for seq, cov in zip(ready, covered):
            found = [(j, lo, hi, entries[k]) for j, lo, hi, k in cov if k in entries]
            if found:
                out += self._measure(seq, found, self._bases(found))
        return out

    def _measure(self, seq: Sequence, found: list[Found], bases: torch.Tensor
                 ) -> list[tuple[Place, torch.Tensor, torch.Tensor, None]]:
        """An anchor per found segment at its place from the end: seq's K/V there, exact,
        minus its base."""
        offsets = self._read(self._rows(seq, found)) - bases
        sizes = [hi - lo for _, lo, hi, _ in found]
        return [(self._place(seq, j - len(seq.shared)), o, b, None)
                for (j, *_), b, o in zip(found, bases.split(sizes, 2), offsets.split(sizes, 2))]

    def _keep(self, new: list[tuple[Place, torch.Tensor, torch.Tensor | None, int | None]]) -> None:
        """The step's new anchors (place, offset, base, per), their tensors held at the
        mode's rank, all factored in one batched call (backend/lowrank.py), and copied
        out of the views they are; a measured offset, kept at two places, is held once."""
        tensors = list({id(t): t for _, o, b, _ in new for t in (o, b) if t is not None}.values())
        held = {id(t): h if isinstance(h, LowRank) else h.clone()
                for t, h in zip(tensors, factor_all(tensors, self.rank))}
        for place, o, b, per in new:
            self.anchors.add(place, held[id(o)], None if b is None else held[id(b)], per)

    def _predict(self, seq: Sequence, found: list[Found], bases: torch.Tensor) -> torch.Tensor | None:
        """The offsets of seq's found segments, side by side, or None if one has none:
        what the text read at its place before, or a prediction from the anchors of its
        place counted from the end."""
        sizes = [hi - lo for _, lo, hi, _ in found]
        parts = bases.split(sizes, 2)
        known = [self.anchors.get(self._place(seq, (j, e.key))) for j, _, _, e in found]
        todo = [i for i, a in enumerate(known) if a is None]
        guessed = iter(())
        if todo:
            new = self.anchors.offsets([self._place(seq, found[i][0] - len(seq.shared)) for i in todo],
                                       torch.cat([parts[i] for i in todo], 2), [sizes[i] for i in todo])
            if new is None:
                return None
            guessed = iter(new.split([sizes[i] for i in todo], 2))
        return torch.cat([a.offset if a is not None else next(guessed) for a in known], 2)

    def _place(self, seq: Sequence, where: object) -> Place:
        """A place of seq's agent in this mode: a shared segment's ordinal from the
        prompt's end (< 0), or (its ordinal from the start, its text's key)."""
        return self.mode, seq.tenant, seq.sender, where
