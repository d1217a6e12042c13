"""CUDA graphs for decode steps.

A decode step launches about forty small kernels per layer; at batch 32 on an H200 the
host spends twice as long launching them as the GPU spends running them. Each batch-size
bucket's forward is captured once and replayed: the step then costs one launch. Inputs
live in static buffers; a batch smaller than its bucket is padded with rows that read and
write one scratch block no sequence owns.
"""

from __future__ import annotations

import torch

from tokendance.backend.model import AttnMeta, Decoder, KVCache
from tokendance.backend.scheduler import Scheduled


def buckets(max_bs: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b <= max_bs]
    out += list(range(16, max_bs + 1, 16))
    return out


class DecodeGraphs:
    def __init__(self, model: Decoder, cache: KVCache, max_bs: int, max_blocks: int, scratch_block: int):
        self.model, self.cache = model, cache
        self.max_blocks = max_blocks
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
        self._capture()

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
        torch.cuda.synchronize()

    def fits(self, work: list[Scheduled]) -> bool:
        return (all(w.count == 1 and w.seq.mirror is None for w in work) and len(work) <= self.sizes[-1]
                and max(len(w.seq.blocks) for w in work) <= self.max_blocks)

    def run(self, work: list[Scheduled]) -> torch.Tensor:
        """Logits [len(work), vocab] of a decode step (every row samples)."""
        n = len(work)
        bs = next(b for b in self.sizes if b >= n)
        bsz = self.cache.block_size
        width = max(len(w.seq.blocks) for w in work)
        ids, pos, slots, lens = [], [], [], []
        table = torch.zeros(n, width, dtype=torch.int32)
        for i, w in enumerate(work):
            p, seq = w.start, w.seq
            ids.append(seq.tokens[p])
            pos.append(p)
            slots.append(seq.blocks[p // bsz] * bsz + p % bsz)
            lens.append(p + 1)
            table[i, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        pad = bs - n
        ids += [0] * pad
        pos += [0] * pad
        slots += [self.scratch_slot] * pad
        lens += [1] * pad
        self.ids[:bs].copy_(torch.tensor(ids), non_blocking=True)
        self.pos[:bs].copy_(torch.tensor(pos), non_blocking=True)
        self.slots[:bs].copy_(torch.tensor(slots), non_blocking=True)
        self.kv_lens[:bs].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        # Padding rows keep whatever table rows they had: they read one valid block
        # (kv_len 1) and write only the scratch slot; their logits are dropped.
        self.tables[:n, :width].copy_(table, non_blocking=True)
        self.graphs[bs].replay()
        return self.logits[:n]
