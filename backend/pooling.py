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


def rows(work: list[Scheduled], cu: list[int]) -> list[int]:
    """The step's rows (by the chunks' starts `cu`) whose hidden states are embeddings:
    each pooling request's last prompt row, in the step that completes its prompt."""
    return [cu[i + 1] - 1 for i, w in enumerate(work) if w.pools]


def split(work: list[Scheduled], kept: torch.Tensor | None
          ) -> tuple[torch.Tensor | None, list[tuple[Scheduled, torch.Tensor]]]:
    """The rows the runner kept (scored rows first, then pooled ones) as (the scored
    rows or None, each pooling chunk with its hidden state)."""
    pools = [w for w in work if w.pools]
    if kept is None:
        return None, []
    n = len(kept) - len(pools)
    return (kept[:n] if n else None), list(zip(pools, kept[n:]))


@torch.inference_mode()
def vector(h: torch.Tensor, normalize: bool) -> list[float]:
    """An embedding of a final hidden state, in float32."""
    v = h.float()
    if normalize:
        v = torch.nn.functional.normalize(v, dim=-1)
    return v.tolist()

