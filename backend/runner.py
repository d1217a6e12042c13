"""Tensors in, logits out: one forward pass over a step's scheduled tokens."""

from __future__ import annotations

import torch

from tokendance.backend.graphs import DecodeGraphs
from tokendance.backend.model import AttnMeta, Decoder, KVCache
from tokendance.backend.scheduler import Scheduled


def step_meta(work: list[Scheduled], block_size: int, device: torch.device) -> tuple[torch.Tensor, AttnMeta, torch.Tensor]:
    """(input ids [T], attention metadata, rows to sample) for a step."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    cu = [0]
    last: list[int] = []
    width = max(len(w.seq.blocks) for w in work)
    tables = torch.zeros(len(work), width, dtype=torch.int32)
    for i, w in enumerate(work):
        seq, end = w.seq, w.start + w.count
        ids.extend(seq.tokens[w.start:end])
        p = range(w.start, end)
        pos.extend(p)
        blocks = seq.blocks
        slots.extend(blocks[j // block_size] * block_size + j % block_size for j in p)
        cu.append(cu[-1] + w.count)
        tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        if w.samples:
            last.append(cu[-1] - 1)
    kv_lens = [w.start + w.count for w in work]

    def t(x: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    meta = AttnMeta(
        positions=t(pos), slots=t(slots), cu_q=t(cu, torch.int32),
        block_tables=tables.to(device, non_blocking=True), kv_lens=t(kv_lens, torch.int32),
        max_q=max(w.count for w in work),
        fresh_cu=cu if all(w.start == 0 for w in work) else None,
    )
    return t(ids), meta, t(last)


class Runner:
    def __init__(self, model: Decoder, cache: KVCache):
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        self.work = 0  # token-layers computed so far (a token through one layer = 1)
        self.graphs: DecodeGraphs | None = None

    def capture(self, max_bs: int, max_blocks: int, scratch_block: int) -> None:
        """Replay decode steps of up to max_bs sequences from CUDA graphs."""
        self.graphs = DecodeGraphs(self.model, self.cache, max_bs, max_blocks, scratch_block)

    @torch.inference_mode()
    def run(self, work: list[Scheduled]) -> torch.Tensor:
        """Logits [rows that sample, vocab] in float32."""
        if self.graphs is not None and self.graphs.fits(work):
            self.work += len(work) * len(self.model.layers)
            return self.graphs.run(work)
        ids, meta, last = step_meta(work, self.cache.block_size, self.device)
        self.work += len(ids) * len(self.model.layers)
        return self.model(ids, meta, self.cache, last)
