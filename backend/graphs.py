"""CUDA graphs for decode steps.

A decode step runs about a dozen kernels per layer, several hundred a step, most of them
a few microseconds long: launched one by one, the host cannot keep up (when steps ran
eagerly, at batch 32 on an H200, it spent twice as long launching kernels as the GPU
spent running them). Each batch-size bucket's forward is captured once and replayed:
the step then costs one launch. Inputs live in static buffers; a batch smaller than its
bucket is padded with rows that read and write one scratch block no sequence owns. A
batch with Mirrors among it replays a second graph per bucket: each view's own-block
tables, and the batch's Master read collectively (backend/tables.py) in a fixed number
of chunks: CHUNK_CAP, or the first of WIDE_CAPS above its segments for a batch that reads
more (many agents in a round, or many rounds' Masters), a graph captured the first time
a batch needs it.

Tables are written in full only when the batch changes; a sequence that gains a block
rewrites its own row; otherwise a replay refreshes just the token ids, positions, store
slots and key counts.
"""

from __future__ import annotations

import time

import structlog
import torch

from tokendance.backend.mirror import EARLY, LATE
from tokendance.backend.model import AttnMeta, Decoder, KVCache
from tokendance.backend.scheduler import Scheduled
from tokendance.backend.tables import kv_view, segments
from tokendance.kernels.master import NOT_READ, MasterRead

log = structlog.get_logger("tokendance.engine")

# Master chunks per Mirror graph (a batch's segments must number fewer); their partials
# follow the own parts' decode splits in the buffer the reduce merges. Padding chunks
# cost: on an H200 ten Mirrors of one round stepped in 5.3 ms with 48, 5.5 with 128 and
# 5.8 with 256 (bench/h200.sh, session 21), so the wide graphs are for batches that
# need them: before them a batch of 48 or more segments stepped eagerly, 48 agents'
# round with 128 tokens each taking 8.6 s instead of 2.7.
CHUNK_CAP = 48
WIDE_CAPS = (256, 1024)


def buckets(max_bs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then steps of 8 (a batch pads to the next),
    and max_bs. (On an H200, 20 sequences stepped 1.5-3 % faster in a graph of 24 rows
    than of 32, with or without Mirrors.)"""
    out = [b for b in (1, 2, 4, 8) if b <= max_bs]
    out += list(range(16, max_bs + 1, 8))
    return out + [max_bs] if out[-1] != max_bs else out


class DecodeGraphs:
    def __init__(self, model: Decoder, cache: KVCache, max_bs: int, max_blocks: int, scratch_block: int,
                 late_from: int = 1, capture: bool = True):
        """`capture=False` allocates the buffers only (tests fill them on the CPU)."""
        self.model, self.cache = model, cache
        self.max_blocks = max_blocks  # per sequence, and for the batch's Master
        self.late_from = late_from
        self.sizes = buckets(max_bs)
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * cache.block_size
        dev = cache.kv.device
        n, w, bsz = self.sizes[-1], max_blocks, cache.block_size

        def full(shape, value, dtype=torch.int32):
            return torch.full(shape, value, dtype=dtype, device=dev)

        # token ids, positions and store slots in one buffer: one copy a step
        self.step = full((3, n), 0, torch.long)
        self.ids, self.pos, self.slots = self.step.unbind(0)
        self.slots.fill_(self.scratch_slot)
        self.cu_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.lens = full((n,), 1)
        self.logits = torch.zeros(n, model.cfg.vocab_size, dtype=torch.float32, device=dev)
        self.tables = full((n, w), scratch_block)  # plain batches
        # Mirror batches: per view, own-block tables and slot positions, and the Master's
        # hidden slots; the Master's blocks, chunks and shifts are the same in both.
        self.views = tuple(dict(tables=full((n, w), scratch_block), pos=full((n, w * bsz), -1),
                                hide=full((n, w * bsz), 0, torch.uint8)) for _ in (EARLY, LATE))
        self.master_table = full((w,), scratch_block)
        self.master = {cap: dict(chunks=full((cap, 3), 0), shift=full((n, cap), 0))
                       for cap in (CHUNK_CAP, *WIDE_CAPS)}
        self._key: tuple | None = None
        self._planned: tuple[list, int | None] = ([], None)  # the last batch planned, its cap
        self._held: list = []  # the sequences _key names (their ids stay theirs meanwhile)
        self._counts: list[int] = []  # their block counts when their rows were written
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.mirror_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (cap, rows)
        self._pool = None
        if capture:
            self._capture()

    def _meta(self, bs: int) -> AttnMeta:
        return AttnMeta(positions=self.pos[:bs], slots=self.slots[:bs], cu_q=self.cu_q[: bs + 1],
                        block_tables=self.tables[:bs], kv_lens=self.lens[:bs], max_q=1)

    def _mirror_meta(self, bs: int, cap: int = CHUNK_CAP) -> AttnMeta:
        early, late = (self._meta(bs) for _ in range(2))
        m = self.master[cap]
        for meta, v in zip((early, late), self.views):
            meta.block_tables, meta.slot_pos = v["tables"][:bs], v["pos"][:bs]
            meta.master = MasterRead(self.master_table, m["chunks"], m["shift"][:bs], v["hide"][:bs])
        early.late, early.late_from = late, self.late_from
        return early

    @torch.inference_mode()
    def _capture(self) -> None:
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self.graphs[bs] = self._graph(self._meta(bs), bs)
        for bs in reversed(self.sizes):
            self.mirror_graphs[CHUNK_CAP, bs] = self._graph(self._mirror_meta(bs), bs)
        torch.cuda.synchronize()

    def _graph(self, meta: AttnMeta, bs: int) -> torch.cuda.CUDAGraph:
        """A decode step of bs rows over the buffers as they are: run once (a warm-up that
        compiles; over a batch's real inputs it stores the same K/V the replay will), then
        captured."""
        self.logits[:bs] = self.model(self.ids[:bs], meta, self.cache)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, self._pool):
            self.logits[:bs] = self.model(self.ids[:bs], meta, self.cache)
        self._pool = g.pool() if self._pool is None else self._pool
        return g

    def fits(self, work: list[Scheduled]) -> bool:
        return self._plan(work) is not None

    def _plan(self, work: list[Scheduled]) -> int | None:
        """The chunk cap of the graph that replays this batch (0: a batch without Mirrors),
        None if no graph can. A graph gives a logits row for each row: every row must
        sample (a one-token chunk inside a prompt does not)."""
        if len(work) > self.sizes[-1] or not all(w.count == 1 and w.samples for w in work):
            return None
        seqs = [w.seq for w in work]
        if any(len(s.blocks) > self.max_blocks for s in seqs):
            return None
        if all(s.mirror is None for s in seqs):
            return 0
        last, cap = self._planned  # held, so no new sequence can have an id of theirs
        if len(last) == len(seqs) and all(a is b for a, b in zip(last, seqs)):
            return cap  # the batch of the last step: its Master has not changed
        segs = segments(seqs)
        fit = sum(len(sp.blocks) for sp in segs.values()) <= self.max_blocks
        cap = next((c for c in (CHUNK_CAP, *WIDE_CAPS) if len(segs) < c), None) if fit else None
        self._planned = (seqs, cap)
        return cap

    def run(self, work: list[Scheduled], ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(work), vocab] of a decode step (every row samples). ids: the
        rows' input tokens on the device (the last step's, not yet read by the host)."""
        bs = next(b for b in self.sizes if b >= len(work))
        cap = self._plan(work)
        assert cap is not None, "run() a batch that fits()"
        self._fill(work, bs, cap)
        if ids is not None:
            self.ids[: len(work)].copy_(ids)
        if not cap:
            g = self.graphs[bs]
        elif (g := self.mirror_graphs.get((cap, bs))) is None:
            t0 = time.perf_counter()
            g = self.mirror_graphs[cap, bs] = self._graph(self._mirror_meta(bs, cap), bs)
            log.info("decode graph captured", rows=bs, master_chunks=cap,
                     ms=round((time.perf_counter() - t0) * 1e3))
        g.replay()
        return self.logits[: len(work)]

    def _fill(self, work: list[Scheduled], bs: int, cap: int) -> None:
        """The step's inputs into the static buffers (cap: the Master chunks of a batch
        with Mirrors, 0 without). Padding rows read the scratch block's first slot and
        write only the scratch slot; their logits are dropped."""
        bsz = self.cache.block_size
        seqs = [w.seq for w in work]
        mirrors = cap > 0
        key = (bs, cap, tuple(id(s) for s in seqs))
        if key != self._key:
            self._tables(work, bs, cap)
            self._key, self._held = key, seqs
            self._counts = [len(s.blocks) for s in seqs]
        else:  # the same batch: only rows that gained a block change
            for i, s in enumerate(seqs):
                if len(s.blocks) != self._counts[i]:
                    self._row(i, s, mirrors)
                    self._counts[i] = len(s.blocks)
        pad = bs - len(work)
        # Plain lists, two transfers: per-element tensor writes cost ~1 ms a step at 32.
        ids = [w.seq.tokens[w.start] for w in work] + [0] * pad
        pos = [w.start for w in work] + [0] * pad
        # a decode token's slot is the same in both views
        slots = [w.seq.slot(w.start, EARLY, bsz, self.scratch_slot) for w in work]
        lens = [w.start + 1 if w.seq.mirror is None else len(w.seq.blocks) * bsz for w in work]
        self.step[:, :bs].copy_(torch.tensor([ids, pos, slots + [self.scratch_slot] * pad]),
                                non_blocking=True)
        self.lens[:bs].copy_(torch.tensor(lens + [1] * pad, dtype=torch.int32), non_blocking=True)

    def _tables(self, work: list[Scheduled], bs: int, cap: int) -> None:
        """Block tables (and, with Mirrors, slot positions and the Master read in `cap`
        chunks) of both views."""
        n, bsz, cpu = len(work), self.cache.block_size, torch.device("cpu")
        seqs, rows = [w.seq for w in work], [torch.tensor([w.start]) for w in work]
        if not cap:
            self._put(self.tables, kv_view(seqs, rows, EARLY, bsz, -1, cpu)["block_tables"], bs,
                      self.scratch_block)
            return
        for view, buf in zip((EARLY, LATE), self.views):
            kv = kv_view(seqs, rows, view, bsz, -1, cpu, collective=True, chunk_cap=cap)
            self._put(buf["tables"], kv["block_tables"], bs, self.scratch_block)
            width = kv["block_tables"].shape[1] * bsz
            sp = torch.full((bs, width), -1, dtype=torch.int32)
            sp[:n] = kv["slot_pos"][:, :width]
            sp[n:, 0] = 0
            buf["pos"][:bs, :width].copy_(sp, non_blocking=True)
            read = kv["master"]
            self._put(buf["hide"], read.hide, bs, 0)
        m = self.master[cap]
        self.master_table[: len(read.table)].copy_(read.table, non_blocking=True)
        m["chunks"].copy_(read.chunks, non_blocking=True)
        self._put(m["shift"], read.shift, bs, NOT_READ)

    def _row(self, i: int, seq, mirrors: bool) -> None:
        """Row i's block table (and, in a Mirror batch, slot positions) after its
        sequence gained a block."""
        bsz = self.cache.block_size
        if seq.mirror is None:
            row = torch.tensor(seq.blocks, dtype=torch.int32)
            for t in [v["tables"] for v in self.views] if mirrors else [self.tables]:
                t[i, : len(row)].copy_(row, non_blocking=True)
            n = len(row) * bsz
            for v in self.views if mirrors else []:
                v["pos"][i, :n].copy_(torch.arange(n, dtype=torch.int32), non_blocking=True)
            return
        for view, buf in zip((EARLY, LATE), self.views):
            blocks, pos = seq.mirror.table(view, seq.blocks, bsz, master=False)
            buf["tables"][i, : len(blocks)].copy_(blocks, non_blocking=True)
            buf["pos"][i, : len(pos)].copy_(pos, non_blocking=True)

    @staticmethod
    def _put(buf: torch.Tensor, src: torch.Tensor, bs: int, pad: int) -> None:
        """src [n, w] into buf[:bs, :w], rows n.. padded with `pad`."""
        n, w = src.shape
        full = torch.full((bs, w), pad, dtype=buf.dtype)
        full[:n] = src
        buf[:bs, :w].copy_(full, non_blocking=True)
