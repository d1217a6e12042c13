"""The KV Collector: prefill a round's requests by reusing shared segments' KV.

For a group of requests it (1) finds each shared segment's base KV in the segment cache
and computes the missing ones once for the whole group: in `collective`, in the same
batched forward as the requests that read them (backend/blend.py), in `pic` standalone
before them; with reader bases, from the group's requests prefilled in full first
(two, or more where prompts quote only some segments); (2) makes each request a Mirror
of those bases, the round's Master: it reads them in place at its own offsets (keys are
stored before RoPE, so placement needs no re-rotation and no copy) and owns private
blocks only for its own tokens and patches; (3) runs selective recomputation:
`collective` as one batched computation per sub-batch of the group, `pic` request by
request. Both give the same result per request; only the schedule differs. (`kvcomm`
predicts what it reuses instead: backend/kvcomm.py.) No forward takes more than
`max_tokens` prompt tokens, except one request's blend when its prompt alone is longer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokendance.backend.anchors import Anchors
from tokendance.backend.api import REUSE_DEFAULTS, InvalidRequest, SamplingParams
from tokendance.backend.batches import batches
from tokendance.backend.blend import BlendInput, blend, early
from tokendance.backend.blocks import BlockManager
from tokendance.backend.detok import Detok
from tokendance.backend.diff import encode
from tokendance.backend.idle import IdleAgents, resumed_mirror
from tokendance.backend.keys import Key, segment_key
from tokendance.backend.kvcomm import PER_PLACE, AnchorReuse
from tokendance.backend.masters import bring_back, parked_spans, restorable
from tokendance.backend.mirror import EARLY, Mirror, Span
from tokendance.backend.model import Decoder, KVCache
from tokendance.backend.runner import Runner
from tokendance.backend.scheduler import Scheduled
from tokendance.backend.segments import Entry, SegmentCache
from tokendance.backend.sequence import Sequence


@dataclass(slots=True)
class ReuseConfig:
    check_layer: int = 1
    # the share of each request's reused tokens recomputed, at most; > 0 floor: of those,
    # only tokens whose KV deviation exceeds it
    ratio: float = REUSE_DEFAULTS["recompute_ratio"]
    floor: float = REUSE_DEFAULTS["recompute_floor"]
    cache_fraction: float = 0.25  # of the pool, for segment bases
    max_tokens: int = 0  # prompt tokens per forward (bases, blend); 0: no limit
    readers: bool = False  # bases from readers' exact prefill (`--bases reader`)
    anchor_bytes: int = 1 << 30  # kvcomm / kvcmas: their anchors' memory (backend/anchors.py)
    anchor_rank: int = 32  # kvcmas: the rank its anchors are held at (backend/lowrank.py)


# Reader bases: requests of a group prefilled in full, whose KV of the shared segments in
# their prompts becomes those segments' bases. At least two, since a reader's own last
# output sits in its history, where it reads as its own turn, while every other reader
# sees it among the others' outputs (the latest occurrence is kept). Beyond two, where
# prompts quote only some of the outputs, a request reads in full when that is less work
# than reading the Master (Collector._readers).
READERS = 2

# Forwards whose layers before the check layer a cold round queues before building its
# Mirrors: each holds its hidden states until its blend (at 16 k tokens of a 7B model,
# ~115 MB), so a large round does not hold them all at once.
AHEAD = 4


def _span(e: Entry, lo: int, n: int) -> Span:
    """A Mirror's span of the segment entry e, placed at lo."""
    return Span(list(e.blocks), lo, n, e.key, e.source, e.version)


class Collector:
    def __init__(self, model: Decoder, cache: KVCache, blocks: BlockManager, runner: Runner,
                 segments: SegmentCache, idle: IdleAgents, cfg: ReuseConfig):
        if not 1 <= cfg.check_layer < model.cfg.num_layers:
            raise InvalidRequest(f"check layer must lie in [1, {model.cfg.num_layers - 1}]", "check_layer")
        if not 0.0 <= cfg.ratio <= 1.0:
            raise InvalidRequest(f"recompute ratio must lie in [0, 1], got {cfg.ratio}", "recompute_ratio")
        if not cfg.floor >= 0.0:  # NaN too: no deviation would ever exceed it
            raise InvalidRequest(f"recompute floor must be >= 0, got {cfg.floor}", "recompute_floor")
        self.model, self.cache, self.blocks, self.runner = model, cache, blocks, runner
        self.segments, self.idle = segments, idle
        self.cfg = cfg
        if not cfg.anchor_rank >= 1:
            raise InvalidRequest(f"anchor rank must be at least 1, got {cfg.anchor_rank}", "anchor_rank")
        self.anchors = Anchors(PER_PLACE, cfg.anchor_bytes, model.tp)  # both modes', apart by place
        self.anchored = {"kvcomm": AnchorReuse(self, "kvcomm", 0),
                         "kvcmas": AnchorReuse(self, "kvcmas", cfg.anchor_rank)}

    # -- bases ----------------------------------------------------------------------

    def reserve(self, seq: Sequence, n: int) -> bool:
        """Blocks for seq's first n tokens, evicting unpinned bases if the pool is short."""
        if self.blocks.reserve(seq, n):
            return True
        self.segments.evict(self.blocks.blocks_for(n))
        return self.blocks.reserve(seq, n)

    def _keep(self, seq: Sequence, lo: int, ids: list[int], key: Key, source: str) -> Entry | None:
        """Copy seq's K/V of positions lo .. lo + len(ids) into fresh blocks entered in the
        segment cache under key: a base made of KV computed in seq's context."""
        holder = Sequence(f"{source}-{key.hex()}", ids, SamplingParams(), Detok(None))
        if not self.reserve(holder, len(ids)):
            return None
        b = self.cache.block_size
        rows = torch.arange(len(ids))
        self.cache.copy(seq.slots(rows + lo, EARLY, b, self.cache.trash), holder.slots(rows, EARLY, b, -1))
        return self.segments.put(key, len(ids), holder.blocks, source)

    def enter_bases(self, missing: dict[Key, list[int]], pinned: list[Entry],
                    entered: list[Entry]) -> list[Sequence]:
        """Reserve blocks for every missing segment and enter them in the segment cache,
        pinned (no later reservation may evict a base before it is computed), to be filled
        by the caller's forwards; `entered` gets the entries. A segment without room is
        left out: requests compute it as private text."""
        out = []
        for key, ids in missing.items():
            seq = Sequence(f"segment-{key}", ids, SamplingParams(), Detok(None))
            if not self.reserve(seq, len(ids)):
                continue
            e = self.segments.put(key, len(ids), seq.blocks, "standalone")
            if e is not None:
                self.segments.pin(e)
                pinned.append(e)
                entered.append(e)
                out.append(seq)
        return out

    def pin(self, keys: list[Key], pinned: list[Entry]) -> dict[Key, Entry]:
        """The segment cache's entries of keys, pinned (and listed in `pinned`)."""
        entries = {k: e for k in keys if (e := self.segments.get(k))}
        for e in entries.values():
            self.segments.pin(e)
            pinned.append(e)
        return entries

    def standalone(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """Prefill seqs in full, alone, in forwards of at most max_tokens tokens (a prompt
        may be split across two, as a chunked prefill); each forward's next-token logits
        (of the prompts it ends), in order."""
        budget = self.cfg.max_tokens or sum(len(s.prompt) for s in seqs)
        work: list[Scheduled] = []
        left = budget
        logits = []
        for seq in seqs:
            start = 0
            while start < len(seq.prompt):
                n = min(len(seq.prompt) - start, left)
                work.append(Scheduled(seq, start, n))
                start, left = start + n, left - n
                if not left:
                    logits.append(self.runner.run(work)[0])
                    work, left = [], budget
        if work:
            logits.append(self.runner.run(work)[0])
        return logits

    def _keys(self, group: list[Sequence]) -> tuple[list[list[tuple[int, int, Key]]], dict[Key, list[int]]]:
        """Per request its shared segments past its restored prefix, (start, end, key);
        the segments among them the cache lacks, key -> tokens."""
        keys: list[list[tuple[int, int, Key]]] = []
        missing: dict[Key, list[int]] = {}
        for seq in group:
            start = seq.resume.length if seq.resume is not None else 0
            spans = []
            for (lo, hi), key in zip(seq.shared, seq.segment_keys()):
                if lo < start:
                    continue  # inside its restored prefix
                spans.append((lo, hi, key))
                if self.segments.get(key) is None:
                    missing[key] = seq.prompt[lo:hi]
            keys.append(spans)
        return keys, missing

    def _choose_readers(self, group: list[Sequence]) -> list[Sequence]:
        """Reader bases: the requests to prefill in full (they get the exact answer; one
        with a parked prefix gives it up and is prefilled whole), their blocks reserved.
        The first READERS that hold segments the cache lacks; after them, one whose
        missing segments no reader holds yet outnumber in tokens what it would compute
        more as a reader than as a Mirror ((1 - r) of its shared tokens, and its parked
        prefix): those bases would cost more prefilled standalone."""
        keys, missing = self._keys(group)
        leads: list[Sequence] = []
        held: set[Key] = set()
        for seq, spans in zip(group, keys):
            mine = {k for _, _, k in spans if k in missing}
            if not mine:
                continue
            if len(leads) >= READERS:
                fresh = sum(len(missing[k]) for k in mine - held)
                more = (1 - self.cfg.ratio) * sum(hi - lo for lo, hi, _ in spans)
                if fresh <= more + (seq.resume.length if seq.resume is not None else 0):
                    continue
            if self.reserve(seq, len(seq.prompt)):
                self.idle.forgo(seq)  # prefilled whole: nothing to restore
                leads.append(seq)
                held |= mine
        return leads

    def _readers(self, leads: list[Sequence], group: list[Sequence], keys: list[list[tuple[int, int, Key]]],
                 missing: dict[Key, list[int]], pinned: list[Entry]) -> torch.Tensor:
        """Prefill the readers `leads` (of `group`) in full and take each segment they hold
        that another request of the group quotes from its latest occurrence there, in
        their context, into a segment entry (pinned); one only readers quote needs no base.
        Those segments leave `missing`; the rest are prefilled standalone as usual."""
        logits = torch.cat(self.standalone(leads))  # in group order, as `leads` is
        best: dict[Key, tuple[Sequence, int]] = {}
        others: set[Key] = set()  # the segments some Mirror of the group reads
        for seq, spans in zip(group, keys):
            if seq not in leads:
                others.update(k for _, _, k in spans)
                continue
            for lo, _, key in spans:
                if key in missing and (key not in best or lo > best[key][1]):
                    best[key] = (seq, lo)
        for key, (seq, lo) in best.items():
            if key not in others:  # its readers computed it in place: no Mirror reads a base
                del missing[key]
                continue
            e = self._keep(seq, lo, missing[key], key, "reader")
            if e is not None:  # else prefilled standalone, or read as private text
                self.segments.pin(e)
                pinned.append(e)
                del missing[key]
        for seq in leads:
            seq.recomputed = seq.cached = 0
            seq.reader = True
            seq.computed = len(seq.prompt)
        return logits

    def _encode(self, leads: list[Sequence], keys: list[list[tuple[int, int, Key]]]) -> None:
        """Readers become Mirrors of the bases their K/V equal (backend/diff.py). Last, once
        the group's forwards are queued: the diff is read back, and the host waits."""
        for seq, spans in zip(leads, keys):
            parts = [_span(e, lo, hi - lo) for lo, hi, key in spans if (e := self.segments.get(key)) is not None]
            encode(seq, parts, self.cache, self.blocks, self.cfg.check_layer, self.model.tp)

    def _mirror(self, seq: Sequence, spans: list[tuple[int, int, Key]],
                entries: dict[Key, Entry]) -> list[bool]:
        """Make seq a Mirror of the bases it finds (one reference to each Master block);
        returns which prompt tokens it reuses (from its restored prefix's end on)."""
        if seq.resume is not None and not restorable(seq.resume, entries):
            self.idle.forgo(seq)  # a Master did not come back: prefill it whole
        r = seq.resume
        start = r.length if r is not None else 0
        reused = [False] * len(seq.prompt)
        parts = []
        for lo, hi, key in spans:
            e = entries.get(key)
            if e is not None and lo >= start:
                parts.append(_span(e, lo, hi - lo))
                reused[lo:hi] = [True] * (hi - lo)
        reused[-1] = False  # the last prompt token is always computed: it samples
        dense_early = self.cfg.check_layer > 1
        if r is None:
            cap = math.ceil(self.cfg.ratio * sum(reused))
            seq.mirror = Mirror.build(len(seq.prompt), parts, reused, dense_early, cap)
        else:
            old = [_span(entries[sp.key], sp.lo, sp.n) for sp in parked_spans(r)]
            seq.mirror = resumed_mirror(r, len(seq.prompt), old, parts, reused[start:], dense_early,
                                        self.cfg.ratio)
        for b in seq.mirror.master_blocks:
            self.blocks.pool.incref(b)
        return reused

    # -- the group ------------------------------------------------------------------

    def prefill(self, group: list[Sequence], mode: str) -> tuple[list[Sequence], torch.Tensor | None]:
        """Prefill what fits of `group` in `mode` (pic, collective, kvcomm or kvcmas); returns those
        sequences (KV in place, stats set) and their next-token logits. Sequences left out
        stay for a later step. If it fails, the bases it entered in the segment cache leave
        it: they may never have been computed, and nobody may read an empty base."""
        if mode in self.anchored:
            return self.anchored[mode].prefill(group)
        entered: list[Entry] = []
        try:
            return self._prefill(group, mode == "collective", entered)
        except BaseException:
            for e in entered:
                self.segments.discard(e)
            raise

    def _prefill(self, group: list[Sequence], batched: bool,
                 entered: list[Entry]) -> tuple[list[Sequence], torch.Tensor | None]:
        pinned: list[Entry] = []
        try:
            # Readers first: one that gives up its parked prefix brings no Master back.
            leads = self._choose_readers(group) if self.cfg.readers else []
            # Masters of restored prefixes come back from the host, not prefilled again.
            masters = bring_back(group, self.segments, self.idle, self.reserve, self.cache.block_size,
                                 self.cache.kv.device, pinned, entered)
            keys, missing = self._keys(group)  # per seq: (start, end, key)
            first, lead_keys = None, []
            if leads:
                first = self._readers(leads, group, keys, missing, pinned)
                lead_keys = [sp for seq, sp in zip(group, keys) if seq in leads]
                keys = [sp for seq, sp in zip(group, keys) if seq not in leads]
                group = [seq for seq in group if seq not in leads]
            bases = self.enter_bases(missing, pinned, entered)
            # collective computes the bases in its first blend forward, beside the
            # Mirrors that read them, when each fits a forward; pic before, alone.
            fold = batched and all(len(b.prompt) <= (self.cfg.max_tokens or len(b.prompt)) for b in bases)
            if not fold:
                self.standalone(bases)
            pre = []  # fresh prompts: the GPU starts now, on the first forwards' early layers
            if fold and all(s.resume is None for s in group):
                runs = batches(bases + group, lambda s: len(s.prompt), self.cfg.max_tokens,
                               remainder_first=True)
                pre = [early(self.model, run, self.cfg.check_layer) for run in runs[:AHEAD]]
            wanted = [k for spans in keys for _, _, k in spans]
            wanted += [sp.key for seq in group if seq.resume is not None for sp in parked_spans(seq.resume)]
            entries = self.pin(wanted, pinned)
            ready, items = [], []
            for seq, spans in zip(group, keys):
                reused = self._mirror(seq, spans, entries)
                need = self.blocks.blocks_for(seq.own_slots(len(seq.prompt)))
                if not self.blocks.reserve(seq, len(seq.prompt)):
                    self.segments.evict(need - len(seq.blocks))
                    if not self.blocks.reserve(seq, len(seq.prompt)):
                        self.blocks.free(seq)  # drops the Mirror: it waits for a later step
                        break
                ready.append(seq)
                items.append(BlendInput(seq, reused, seq.resume.length if seq.resume else 0))
            resumed = [(s.resume, s) for s in ready if s.resume is not None]
            if resumed or masters:  # one fused restore for the group
                self.idle.restore(resumed, masters)
        finally:
            for e in pinned:
                self.segments.unpin(e)
        for seq in group:
            if seq not in ready:
                self.idle.forgo(seq)  # a later step prefills it whole
        if not ready:
            if fold:
                self.standalone(bases)
            self._encode(leads, lead_keys)
            return leads, first
        lead = [BlendInput(b, [False] * len(b.prompt)) for b in bases] if fold else []
        if batched:
            # Per request the math does not depend on the batch: split by budget, the
            # remainder first. Only the first forward's host work (its Mirrors' tables,
            # the late view) has no GPU work to hide behind; each later one's is done while
            # the GPU computes the one before (on an H200, N = 10: 211.5 -> 198.8 ms).
            subs = batches(lead + items, lambda it: len(it.seq.prompt) - it.start, self.cfg.max_tokens,
                           remainder_first=True)
        else:
            subs = [[it] for it in items]
        parts = [blend(self.model, self.cache, sub, self.cfg.check_layer, self.cfg.ratio, self.cfg.floor,
                       pre[i] if i < len(pre) else None) for i, sub in enumerate(subs)]
        logits = torch.cat([p.logits for p in parts])[len(lead):]
        selected = [sel for p in parts for sel in p.selected][len(lead):]
        self.runner.work += sum(p.work for p in parts)
        for seq, it, sel in zip(ready, items, selected):
            n_reused = sum(it.reused[it.start:])
            seq.recomputed = len(sel)
            seq.cached = it.start + n_reused - len(sel)  # restored or reused, not computed
            seq.computed = len(seq.prompt)
            seq.resume = None
            if seq.mirror.trim():  # a floor left patch room unused: its blocks go back
                self.blocks.trim(seq)
        self._encode(leads, lead_keys)
        return leads + ready, logits if first is None else torch.cat([first, logits])

    # -- producer chaining -----------------------------------------------------------

    def publish_output(self, seq: Sequence, ids: list[int], at: int = 0) -> None:
        """Keep the KV the producer computed for its own output's tokens `ids` (from
        out[at] on) as their base."""
        start = len(seq.prompt) + at
        if not ids or seq.out[at:at + len(ids)] != ids or start + len(ids) > seq.computed:
            return
        self._keep(seq, start, ids, segment_key(seq.tenant, ids), "producer")
