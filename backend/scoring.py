"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and
its top alternatives (vLLM's `prompt_logprobs`; the legacy completions' `echo` with
`logprobs`).

They come from rows a prefill already computes: the row of position p predicts the
token at p + 1, so a step that prefills positions [start, start + count) of a scoring
request keeps those rows' final hidden states too (`rows`), besides the rows it samples
from, and `record` turns them into logprobs `ROWS` rows at a time, so a prompt of any
length is scored in the steps that prefill it; they are kept by position (a preempted
request computed again writes the same values). Only `full` computes every prompt token
(the others reuse KV and skip them), so a request that asks for them runs in `full`
(Engine.add). Nothing predicts the first token: its logprob is None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokendance.backend.api import TokenLogprob, TopLogprob
from tokendance.backend.upload import upload_list

if TYPE_CHECKING:
    from tokendance.backend.detok import Pieces
    from tokendance.backend.model import Decoder
    from tokendance.backend.scheduler import Scheduled

# Rows whose logits `record` holds at once: float32 rows of the vocabulary (1,024 of
# Qwen2.5's 152 k: 0.6 GB, and as much for their log-softmax). backend/budget.py counts them.
ROWS = 1024


def start(prompt: list[int], pieces: Pieces) -> list[TokenLogprob | None]:
    """A request's scores before its prefill: the first token's (its logprob None), the
    rest to come."""
    ((s, b),) = pieces(prompt[:1])
    return [TokenLogprob(s, None, b)] + [None] * (len(prompt) - 1)


def count(w: Scheduled) -> int:
    """How many rows of this scheduled chunk predict a prompt token to be scored."""
    if w.seq.scored is None:
        return 0
    return max(0, min(w.count, len(w.seq.prompt) - 1 - w.start))


def rows(work: list[Scheduled], cu: list[int]) -> list[int]:
    """The step's rows (by the chunks' starts `cu`) whose logits score prompt tokens."""
    return [r for w, at in zip(work, cu) for r in range(at, at + count(w))]


@torch.inference_mode()
def scores(model: Decoder, h: torch.Tensor, targets: torch.Tensor, k: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(The logprob of each row's target [R] and its rank (1 + how many tokens are likelier)
    [R], the k best alternatives' ids and logprobs [R, k]) of the final hidden states `h`
    [R, hidden], `ROWS` rows at a time."""
    picked, ranks, ids, vals = [], [], [], []
    for at in range(0, len(h), ROWS):
        logp = model.head(h[at:at + ROWS]).log_softmax(-1)
        own = logp.gather(-1, targets[at:at + ROWS, None])
        picked.append(own[:, 0])
        ranks.append((logp > own).sum(-1, dtype=torch.int32) + 1)  # int32: half the time of int64 on a CPU
        top = logp.topk(k, -1)
        ids.append(top.indices)
        vals.append(top.values)
    return torch.cat(picked), torch.cat(ranks), torch.cat(ids), torch.cat(vals)


def record(work: list[Scheduled], h: torch.Tensor | None, model: Decoder, pieces: Pieces) -> None:
    """Keep the scores of the final hidden states `h` (the `rows` of this step, in their
    order): each request's k best alternatives, raw logits as for sampled tokens
    (backend/sampler.py)."""
    if h is None:
        return
    parts = [(w, n) for w in work if (n := count(w))]
    targets = [t for w, n in parts for t in w.seq.prompt[w.start + 1:w.start + 1 + n]]
    k = max(w.seq.sampling.prompt_logprobs or 0 for w, _ in parts)
    got = scores(model, h, upload_list(targets, torch.int64, h.device), k)
    picked, ranks, top_ids, top_lps = (x.tolist() for x in got)
    ids = list({t for row in (targets, *top_ids) for t in row})
    text = dict(zip(ids, pieces(ids)))
    r = 0
    for w, n in parts:
        k = w.seq.sampling.prompt_logprobs or 0
        for j in range(w.start + 1, w.start + 1 + n):
            tok = targets[r]
            s, b = text[tok]
            w.seq.scored[j] = TokenLogprob(s, picked[r], b, [
                TopLogprob(text[a][0], v, text[a][1], a) for a, v in zip(top_ids[r][:k], top_lps[r][:k])],
                tok, ranks[r])
            r += 1
