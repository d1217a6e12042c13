"""Next-token choice for a batch: logit bias and penalties (backend/penalties.py), the
ends a request may not take yet (`min_tokens`), a structured output's grammar
(backend/grammar.py), a think block's end forced at its budget (backend/thinking.py),
then greedy, or temperature, min-p, top-k and top-p (vLLM's order: top-p over what min-p
and top-k left, renormalized) and a draw with per-request seeds; and the
log-probabilities of chosen (and top, or asked-for) tokens under the model's
distribution."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokendance.backend.api import SamplingParams, TokenLogprob, TopLogprob
from tokendance.backend.grammar import mask
from tokendance.backend.penalties import Penalized
from tokendance.backend.sequence import Sequence
from tokendance.backend.upload import upload_list

if TYPE_CHECKING:
    from tokendance.backend.detok import Pieces


@dataclass(slots=True)
class Sampled:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None

    def written(self, pieces: Pieces) -> TokenLogprob:
        """Its logprob and alternatives, with their texts (`logprob` must be set)."""
        top = self.top or []
        (s, b), *alts = pieces([self.token] + [t for t, _ in top])
        return TokenLogprob(s, self.logprob, b, [TopLogprob(ts, lp, tb, t) for (ts, tb), (t, lp) in zip(alts, top)],
                            self.token)


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
            renorm: bool) -> torch.Tensor:
    """Mask (to -inf) what min-p, top-k and top-p exclude, per row; the likeliest token
    always stays. `renorm`: some row has min-p or top-k, whose survivors top-p measures."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    probs = sorted_logits.softmax(-1)
    drop = probs < min_p[:, None] * probs[:, :1]
    drop |= (top_k[:, None] > 0) & (rank >= top_k[:, None])
    if renorm:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= (probs.cumsum(-1) - probs) > top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _not_yet(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """New logits with the ends (EOS, stop_token_ids) of rows short of their min_tokens at
    -inf; `logits` itself when there are none. A structured output may end whenever its
    grammar is complete."""
    rows, cols = [], []
    for i, s in enumerate(seqs):
        if s.ends and len(s.out) < s.sampling.min_tokens and s.matcher is None:
            rows += [i] * len(s.ends)
            cols += s.ends
    if not rows:
        return logits
    at = (upload_list(rows, torch.long, logits.device), upload_list(cols, torch.long, logits.device))
    return logits.index_put(at, logits.new_full((), float("-inf")))


def _force(logits: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
    """New logits where each (row, token) of `rows` can take only its token (a think
    block's end at its budget: backend/thinking.py), whatever else barred it."""
    r = upload_list([i for i, _ in rows], torch.long, logits.device)
    t = upload_list([t for _, t in rows], torch.long, logits.device)
    out = logits.index_fill(0, r, float("-inf"))
    out[r, t] = 0.0
    return out


def choose(logits: torch.Tensor, seqs: list[Sequence], default: torch.Generator | None) -> torch.Tensor:
    """Token ids [S] on the logits' device, without waiting for the device: a decode
    step's tokens can feed the next step before the host reads them. `logits` stay raw."""
    params = [s.sampling for s in seqs]
    penalized = Penalized.of(logits, seqs)
    if penalized is not None:
        logits = penalized.apply(logits)
    logits = _not_yet(logits, seqs)
    if any(s.matcher is not None for s in seqs):
        logits = mask(logits, [s.matcher for s in seqs])
    forced = [(i, t) for i, s in enumerate(seqs) if s.thought is not None and (t := s.thought.next()) is not None]
    if forced:
        logits = _force(logits, forced)
    chosen = logits.argmax(-1)
    if not all(p.greedy for p in params):
        chosen = draw(probabilities(logits, params), seqs, default, chosen)
    if penalized is not None:
        penalized.count(chosen)
    return chosen


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's distribution to draw from: its temperature (a greedy row's 1), then min-p,
    top-k and top-p."""
    temp = upload_list([1.0 if p.greedy else p.temperature for p in params], torch.float32, logits.device)
    scaled = logits / temp[:, None]
    if any(p.top_k or p.top_p < 1.0 or p.min_p for p in params):  # else no sort over the vocabulary
        vocab = logits.shape[-1]  # a larger top_k keeps every token (and may not fit a long)
        top_k = upload_list([min(p.top_k, vocab) for p in params], torch.long, logits.device)
        top_p = upload_list([p.top_p for p in params], torch.float32, logits.device)
        min_p = upload_list([p.min_p for p in params], torch.float32, logits.device)
        scaled = _filter(scaled, top_k, top_p, min_p, any(p.top_k or p.min_p for p in params))
    return scaled.softmax(-1)


def draw(probs: torch.Tensor, seqs: list[Sequence], default: torch.Generator | None,
          greedy: torch.Tensor) -> torch.Tensor:
    """A token per sampled row, as vLLM draws it: the argmax of probs / E for E ~ Exp(1)
    (a draw from probs), with E for the whole batch in one launch from `default` and a
    seeded row's own from its generator; greedy rows keep `greedy`. A row pushed past float
    range (a tiny repetition_penalty makes a logit inf) has no distribution: it keeps its
    argmax too, without a sync and without failing its batch."""
    e = torch.empty_like(probs).exponential_(generator=default)
    for i, s in enumerate(seqs):
        if s.generator is not None and not s.sampling.greedy:
            e[i].exponential_(generator=s.generator)
    drawn = (probs / e.clamp_(min=torch.finfo(e.dtype).tiny)).argmax(-1)
    take = upload_list([not s.sampling.greedy for s in seqs], torch.bool, probs.device)
    take &= probs.sum(-1).isfinite()
    return torch.where(take, drawn, greedy)


def sample(logits: torch.Tensor, seqs: list[Sequence], default: torch.Generator | None) -> list[Sampled]:
    """logits [S, V] float32, one row per sequence. Log-probabilities are of these raw
    logits, before bias, penalties and temperature (vLLM's default, raw_logprobs)."""
    chosen = choose(logits, seqs, default)
    out = [Sampled(int(t)) for t in chosen.tolist()]
    attach(out, logits, [s.sampling for s in seqs], chosen)
    return out


def attach(out: list[Sampled], logits: torch.Tensor, params: list[SamplingParams], chosen: torch.Tensor) -> None:
    """The logprobs of the rows that want them: each chosen token's (`chosen` [S] on the
    device), and its row's top or asked-for tokens', from the raw `logits` [S, V]."""
    want = [i for i, p in enumerate(params) if p.logprobs]
    if not want:
        return
    logp = logits[want].log_softmax(-1)
    picked = logp.gather(-1, chosen[want][:, None])[:, 0].tolist()
    k = max((params[i].top_logprobs for i in want if params[i].logprob_token_ids is None), default=0)
    top = logp.topk(k, -1) if k else None
    labels = _labels(logp, [params[i].logprob_token_ids for i in want])
    for j, i in enumerate(want):
        out[i].logprob = picked[j]
        n = params[i].top_logprobs
        if labels[j] is not None:
            out[i].top = labels[j]
        elif top is not None and n:
            out[i].top = list(zip(top.indices[j, :n].tolist(), top.values[j, :n].tolist()))


def _labels(logp: torch.Tensor, ids: list[list[int] | None]) -> list[list[tuple[int, float]] | None]:
    """Per row, its label tokens' logprobs in the order asked (vLLM's logprob_token_ids),
    gathered for the whole batch at once; None for a row that asked for none."""
    rows = [j for j, x in enumerate(ids) if x]
    if not rows:
        return [None] * len(ids)
    width = max(len(ids[j]) for j in rows)
    index = upload_list([t for j in rows for t in ids[j] + [0] * (width - len(ids[j]))], torch.long,
                        logp.device).view(len(rows), width)
    got = logp[rows].gather(-1, index).tolist()
    out: list[list[tuple[int, float]] | None] = [None] * len(ids)
    for j, vals in zip(rows, got):
        out[j] = list(zip(ids[j], vals))
    return out
