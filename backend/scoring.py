"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and
its top alternatives (vLLM's `prompt_logprobs`; the legacy completions' `echo` with
`logprobs`).

They come from rows a prefill already computes: the row of position p predicts the
token at p + 1, so a step that prefills positions [start, start + count) of a scoring
request reads the logits of those rows too (`rows`), besides the rows it samples from,
and `record` keeps them by position (a preempted request computed again writes the same
values). Only `full` computes every prompt token (the others reuse KV and skip them),
so a request that asks for them runs in `full` (Engine.add). Nothing predicts the first
token: its logprob is None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokendance.backend.api import TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from tokendance.backend.detok import Pieces
    from tokendance.backend.scheduler import Scheduled
    from tokendance.backend.sequence import Sequence

# Prompt rows a step scores at most: their logits are float32 rows of the vocabulary
# (1,024 of Qwen2.5's 152 k: 0.6 GB, and as much for their log-softmax).
ROWS = 1024


def start(prompt: list[int], pieces: Pieces) -> list[TokenLogprob | None]:
    """A request's scores before its prefill: the first token's (its logprob None), the
    rest to come."""
    ((s, b),) = pieces(prompt[:1])
    return [TokenLogprob(s, None, b)] + [None] * (len(prompt) - 1)


def fit(seq: Sequence, n: int, rows: int) -> int:
    """How many of the next `n` tokens of `seq` a step takes when `rows` more prompt rows
    may be scored in it (all of them unless `seq` scores its prompt)."""
    if seq.scored is None:
        return n
    scored = max(0, len(seq.prompt) - 1 - seq.computed)  # its next tokens that score one
    return n if n <= rows or scored <= rows else rows


def count(w: Scheduled) -> int:
    """How many rows of this scheduled chunk predict a prompt token to be scored."""
    if w.seq.scored is None:
        return 0
    return max(0, min(w.count, len(w.seq.prompt) - 1 - w.start))


def rows(work: list[Scheduled], cu: list[int]) -> list[int]:
    """The step's rows (by the chunks' starts `cu`) whose logits score prompt tokens."""
    return [r for w, at in zip(work, cu) for r in range(at, at + count(w))]


def record(work: list[Scheduled], logits: torch.Tensor, pieces: Pieces) -> None:
    """Keep the scores of `logits` (the `rows` of this step, in their order): each
    request's k best alternatives, raw logits as for sampled tokens (backend/sampler.py)."""
    if not len(logits):
        return
    logp = logits.log_softmax(-1)
    at, parts = 0, []
    for w in work:
        n = count(w)
        if not n:
            continue
        targets = w.seq.prompt[w.start + 1:w.start + 1 + n]
        part = logp[at:at + n]
        picked = part.gather(-1, torch.tensor(targets, device=logp.device)[:, None])[:, 0].tolist()
        k = w.seq.sampling.prompt_logprobs or 0
        top = part.topk(k, -1) if k else None
        alts = (top.indices.tolist(), top.values.tolist()) if top is not None else ([[]] * n, [[]] * n)
        parts.append((w, targets, picked, *alts))
        at += n
    ids = list({t for _, targets, _, tops, _ in parts for row in (targets, *tops) for t in row})
    text = dict(zip(ids, pieces(ids)))
    for w, targets, picked, top_ids, top_lps in parts:
        for j, (tok, lp, alt, alt_lp) in enumerate(zip(targets, picked, top_ids, top_lps)):
            s, b = text[tok]
            w.seq.scored[w.start + 1 + j] = TokenLogprob(s, lp, b, [
                TopLogprob(text[a][0], v, text[a][1]) for a, v in zip(alt, alt_lp)])
