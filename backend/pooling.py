"""Embeddings: a prompt's last token's final (normed) hidden state, as vLLM pools a
generative model converted to embeddings (`--convert embed`: last-token pooling,
normalized to unit length by default).

A pooling request prefills like any other, in the steps its prompt is scheduled in; the
step that completes its prompt keeps that row's final hidden state instead of sampling
from it (`Scheduled.pools`), and the request finishes there. The runner hands such rows
back after the rows that score prompt tokens (backend/scoring.py), so `split` parts them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokendance.backend.scheduler import Scheduled
    from tokendance.backend.sequence import Sequence


def rows(work: list[Scheduled], cu: list[int]) -> list[int]:
    """The step's rows (by the chunks' starts `cu`) whose hidden states are embeddings:
    each pooling request's last prompt row, in the step that completes its prompt."""
    return [cu[i + 1] - 1 for i, w in enumerate(work) if w.pools]


def split(work: list[Scheduled], kept: torch.Tensor | None
          ) -> tuple[torch.Tensor | None, list[tuple[Sequence, list[float]]]]:
    """The rows the runner kept (scored rows first, then pooled ones) as (the scored
    rows or None, each pooling request with its embedding, in float32: read from the
    device in one copy)."""
    seqs = [w.seq for w in work if w.pools]
    if kept is None:
        return None, []
    n = len(kept) - len(seqs)
    if not seqs:
        return kept, []
    with torch.inference_mode():
        v = kept[n:].float()
        unit = torch.tensor([s.pooling.normalize for s in seqs], device=v.device)[:, None]
        v = torch.where(unit, torch.nn.functional.normalize(v, dim=-1), v)
    return (kept[:n] if n else None), list(zip(seqs, v.tolist()))
