"""Tensors in, logits out: one forward pass over a step's scheduled tokens."""

from __future__ import annotations

import structlog
import torch

from tokendance.backend import pooling, scoring
from tokendance.backend.graphs import DecodeGraphs
from tokendance.backend.mirror import EARLY, LATE
from tokendance.backend.model import AttnMeta, Decoder, KVCache
from tokendance.backend.scheduler import Scheduled
from tokendance.backend.tables import kv_view
from tokendance.backend.upload import upload_list
from tokendance.kernels.rotated import RotatedKeys, RotatedStep

log = structlog.get_logger("tokendance.engine")


def step_meta(work: list[Scheduled], block_size: int, device: torch.device, trash: int = -1,
              late_from: int = 1, collective: bool | None = None
              ) -> tuple[torch.Tensor, AttnMeta, torch.Tensor]:
    """(input ids [T], attention metadata, rows to sample) for a step. A decode step over
    Mirrors reads the Master collectively (`collective`, by default on CUDA: the CPU
    reference gains nothing from it and pays for the plan)."""
    ids: list[int] = []
    pos: list[int] = []
    cu = [0]
    last: list[int] = []
    for w in work:
        ids.extend((w.seq.tokens + w.seq.draft if w.drafts else w.seq.tokens)[w.start:w.start + w.count])
        pos.extend(range(w.start, w.start + w.count))
        cu.append(cu[-1] + w.count)
        if w.samples:  # and a row for each draft (backend/speculate.py)
            last.extend(range(cu[-1] - 1 - w.drafts, cu[-1]))
    last += scoring.rows(work, cu) + pooling.rows(work, cu)  # after the sampled rows: Runner.run splits them so

    def t(x: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return upload_list(x, dtype, device)

    common = dict(positions=t(pos), cu_q=t(cu, torch.int32), max_q=max(w.count for w in work))
    seqs = [w.seq for w in work]
    rows = [torch.arange(w.start, w.start + w.count) for w in work]
    if all(s.mirror is None for s in seqs):
        fresh = all(w.start == 0 for w in work)  # attention over the step's own K/V only
        meta = AttnMeta(**common, **kv_view(seqs, rows, EARLY, block_size, trash, device, reads=not fresh),
                        fresh_cu=cu if fresh else None)
    else:  # Mirrors: two views; a decode step reads the Master collectively
        if collective is None:
            collective = torch.device(device).type == "cuda"
        decode = collective and common["max_q"] == 1
        meta = AttnMeta(**common, **kv_view(seqs, rows, EARLY, block_size, trash, device, decode))
        meta.late = AttnMeta(**common, **kv_view(seqs, rows, LATE, block_size, trash, device, decode))
        meta.late_from = late_from
    return t(ids), meta, t(last)


class Runner:
    def __init__(self, model: Decoder, cache: KVCache):
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        self.work = 0  # token-layers computed so far (a token through one layer = 1)
        self.late_from = 1  # Mirrors: the check layer, where their late view starts
        self.graphs: DecodeGraphs | None = None
        self.eager_decodes = 0  # decode steps no graph could replay (with graphs captured)
        # CPU decode: each layer keeps its batch's keys rotated from step to step, in at
        # most the bytes of the pool in the model's dtype (an 8-bit pool's four times fewer
        # would leave a batch's keys gathered again every step: kernels/rotated.py)
        self.rotated = (RotatedKeys(cache.kv.numel() * cache.dtype.itemsize, len(model.layers))
                        if self.device.type == "cpu" else None)

    def release(self) -> None:
        """Drop what decode steps hold between them (nothing left to decode)."""
        if self.rotated is not None:
            self.rotated.clear()

    def capture(self, max_bs: int, max_blocks: int, scratch_block: int) -> None:
        """Replay decode steps of up to max_bs sequences from CUDA graphs."""
        self.graphs = DecodeGraphs(self.model, self.cache, max_bs, max_blocks, scratch_block,
                                   self.late_from)

    @torch.inference_mode()
    def run(self, work: list[Scheduled], ids: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(Logits [rows that sample, vocab] in float32 (a sequence with drafts: 1 + drafts
        rows), the final hidden states of the rows that score prompt tokens and then of
        those that pool them, or None:
        backend/scoring.py and backend/pooling.py read them). ids: a
        decode step's input tokens on the device, when the host has not read them
        (backend/lookahead.py)."""
        if self.graphs is not None:
            if self.graphs.fits(work):
                self.work += len(work) * len(self.model.layers)
                return self.graphs.run(work, ids), None
            if all(w.count == 1 and w.samples for w in work):
                if not self.eager_decodes:
                    log.warning("a decode step runs without a CUDA graph (slower): its batch is "
                                "over the graphs' rows, a sequence over the context, or Mirrors read "
                                "too many Master segments", rows=len(work))
                self.eager_decodes += 1
        tokens, meta, last = step_meta(work, self.cache.block_size, self.device, self.cache.trash,
                                       self.late_from)
        ids = tokens if ids is None else ids
        self.work += len(ids) * len(self.model.layers)
        if self.rotated is not None and all(w.count == 1 and w.samples for w in work):
            rows, qpos = tuple(w.seq for w in work), [w.start for w in work]
            for m in (meta, meta.late):
                if m is not None:
                    m.plan["rotated"] = RotatedStep(self.rotated, rows, qpos, m.slots)
        h = self.model.states(ids, meta, self.cache, last)
        n = sum(1 + w.drafts for w in work if w.samples)  # the sampled rows come first (step_meta)
        return self.model.head(h[:n]), (h[n:] if len(h) > n else None)
