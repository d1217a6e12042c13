"""CUDA graphs for decode steps.

A decode step launches about forty small kernels per layer; at batch 32 on an H200 the
host spends twice as long launching them as the GPU spends running them. Each batch-size
bucket's forward is captured once and replayed: the step then costs one launch. Inputs
live in static buffers; a batch smaller than its bucket is padded with rows that read and
write one scratch block no sequence owns. A batch with Mirrors among it replays a second
graph per bucket whose attention reads both views' slot-position tables.
"""

from __future__ import annotations

import torch

from tokendance.backend.mirror import EARLY, LATE
from tokendance.backend.model import AttnMeta, Decoder, KVCache
from tokendance.backend.scheduler import Scheduled
from tokendance.backend.tables import kv_view


def buckets(max_bs: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b <= max_bs]
    out += list(range(16, max_bs + 1, 16))
    return out


class DecodeGraphs:
    def __init__(self, model: Decoder, cache: KVCache, max_bs: int, max_blocks: int, scratch_block: int,
                 late_from: int = 1):
        self.model, self.cache = model, cache
        self.max_blocks = max_blocks
        self.late_from = late_from
        self.sizes = buckets(max_bs)
        dev = model.lm_head.weight.device
        n = self.sizes[-1]
        bsz = cache.block_size
        self.scratch_slot = scratch_block * bsz
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        self.cu_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int32, device=dev)
        self.kv_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.logits = torch.zeros(n, model.cfg.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.scratch_block = scratch_block
        # Mirror tables (own blocks, then the Master's): per view, tables, lens, pos.
        self.mirror_blocks = 2 * max_blocks
        self.mirror_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.views = self._alloc_views()
        self.pool = None
        self._capture()
        for bs in reversed(self.sizes):
            self._capture_mirror(bs)

    def _meta(self, bs: int) -> AttnMeta:
        return AttnMeta(positions=self.pos[:bs], slots=self.slots[:bs], cu_q=self.cu_q[: bs + 1],
                        block_tables=self.tables[:bs], kv_lens=self.kv_lens[:bs], max_q=1)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            meta = self._meta(bs)
            self.logits[:bs] = self.model(self.ids[:bs], meta, self.cache)  # warm-up, compiles kernels
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool):
                self.logits[:bs] = self.model(self.ids[:bs], meta, self.cache)
            pool = g.pool() if pool is None else pool
            self.graphs[bs] = g
        self.pool = pool
        torch.cuda.synchronize()

    def _mirror_meta(self, bs: int) -> AttnMeta:
        early, late = (self._meta(bs) for _ in range(2))
        for m, v in zip((early, late), self.views):
            m.block_tables, m.kv_lens, m.slot_pos = v["tables"][:bs], v["lens"][:bs], v["pos"][:bs]
        early.late, early.late_from = late, self.late_from
        return early

    def _alloc_views(self) -> tuple[dict[str, torch.Tensor], ...]:
        n, dev, w = self.sizes[-1], self.ids.device, self.mirror_blocks
        bsz = self.cache.block_size
        return tuple(
            dict(tables=torch.full((n, w), self.scratch_block, dtype=torch.int32, device=dev),
                 lens=torch.ones(n, dtype=torch.int32, device=dev),
                 pos=torch.zeros(n, w * bsz, dtype=torch.int32, device=dev))
            for _ in (EARLY, LATE))

    @torch.inference_mode()
    def _capture_mirror(self, bs: int) -> None:
        meta = self._mirror_meta(bs)
        self.logits[:bs] = self.model(self.ids[:bs], meta, self.cache)  # compiles the kernels
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, self.pool):
            self.logits[:bs] = self.model(self.ids[:bs], meta, self.cache)
        torch.cuda.synchronize()
        self.mirror_graphs[bs] = g

    def fits(self, work: list[Scheduled]) -> bool:
        if len(work) > self.sizes[-1] or not all(w.count == 1 for w in work):
            return False
        bsz = self.cache.block_size
        return all(len(w.seq.blocks) <= self.max_blocks if w.seq.mirror is None
                   else len(w.seq.blocks) + len(w.seq.mirror.master_blocks) <= self.mirror_blocks
                   for w in work)

    def run(self, work: list[Scheduled]) -> torch.Tensor:
        """Logits [len(work), vocab] of a decode step (every row samples)."""
        bs = next(b for b in self.sizes if b >= len(work))
        mirrors = self._fill(work, bs)
        (self.mirror_graphs if mirrors else self.graphs)[bs].replay()
        return self.logits[: len(work)]

    def _fill(self, work: list[Scheduled], bs: int) -> bool:
        """The step's inputs into the static buffers (both views' tables with Mirrors
        among them, which it returns). Padding rows read the scratch block's first slot
        and write only the scratch slot; their logits are dropped."""
        n, bsz, cpu = len(work), self.cache.block_size, torch.device("cpu")
        seqs, rows = [w.seq for w in work], [torch.tensor([w.start]) for w in work]
        mirrors = any(s.mirror is not None for s in seqs)
        ids = torch.zeros(bs, dtype=torch.long)
        ids[:n] = torch.tensor([w.seq.tokens[w.start] for w in work])
        pos = torch.zeros(bs, dtype=torch.long)
        pos[:n] = torch.tensor([w.start for w in work])
        plain = dict(tables=self.tables, lens=self.kv_lens)
        for view, buf in zip((EARLY, LATE), self.views) if mirrors else [(EARLY, plain)]:
            kv = kv_view(seqs, rows, view, bsz, self.scratch_slot, cpu)
            width = kv["block_tables"].shape[1]
            table = torch.full((bs, width), self.scratch_block, dtype=torch.int32)
            table[:n] = kv["block_tables"]
            lens = torch.ones(bs, dtype=torch.int32)
            lens[:n] = kv["kv_lens"]
            buf["tables"][:bs, :width].copy_(table, non_blocking=True)
            buf["lens"][:bs].copy_(lens, non_blocking=True)
            if mirrors:
                sp = torch.full((bs, width * bsz), -1, dtype=torch.int32)
                sp[:n] = kv["slot_pos"]
                sp[n:, 0] = 0
                buf["pos"][:bs, : width * bsz].copy_(sp, non_blocking=True)
        slots = torch.full((bs,), self.scratch_slot, dtype=torch.long)
        slots[:n] = kv["slots"]  # a decode token's slot is the same in both views
        self.ids[:bs].copy_(ids, non_blocking=True)
        self.pos[:bs].copy_(pos, non_blocking=True)
        self.slots[:bs].copy_(slots, non_blocking=True)
        return mirrors
