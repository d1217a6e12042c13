"""Logit bias and penalties: the logits a request samples from, changed by its bias, by
the tokens it may not sample (backend/banned.py) and by the tokens it has seen.

vLLM's order and math: the bias is added first; then the repetition penalty over prompt
and generated tokens (a seen token's positive logit divided by it, a negative one
multiplied); then OpenAI's frequency and presence penalties over the generated tokens,
logit[t] -= frequency * count[t], then -= presence * (count[t] > 0). Temperature,
top-k / top-p and the greedy argmax come after (backend/sampler.py). Reported
log-probabilities stay those of the raw logits, as vLLM's default (`logprobs_mode`
raw_logprobs) has them.

A decode step's tokens may feed the next step before the host has read them
(backend/lookahead.py), so the host cannot count them: a penalized sequence keeps its
counts on the device, and they are updated from the chosen ids on the device, in stream
order. A batch without penalized requests never builds any of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokendance.backend.banned import banned
from tokendance.backend.sequence import Sequence
from tokendance.backend.upload import upload_list


@dataclass(slots=True)
class Seen:
    """One penalized sequence's state on the device."""

    counts: torch.Tensor  # [V] int32: how often each token was generated
    prompt: torch.Tensor | None  # [V] bool: in the prompt; only with a repetition penalty
    bias_ids: torch.Tensor | None  # [k] long: logit_bias's token ids
    bias: torch.Tensor | None  # [k] float32: their biases
    barred: torch.Tensor | None  # [V] bool: the tokens outside allowed_token_ids

    @classmethod
    def of(cls, seq: Sequence, vocab: int, device: torch.device) -> Seen:
        """Built at the sequence's first sampling, from what the host knows then."""
        p = seq.sampling
        counts = torch.zeros(vocab, dtype=torch.int32, device=device)
        out = [t for t in seq.out if t >= 0]  # every token the sequence has generated
        if out:
            counts.index_add_(0, upload_list(out, torch.long, device),
                              torch.ones(len(out), dtype=torch.int32, device=device))
        prompt = None
        if p.repetition_penalty != 1.0:
            prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt.index_fill_(0, upload_list(seq.prompt, torch.long, device), True)
        ids = bias = None
        if p.logit_bias:
            ids = upload_list(list(p.logit_bias), torch.long, device)
            bias = upload_list(list(p.logit_bias.values()), torch.float32, device)
        barred = None
        if p.allowed_token_ids is not None:
            barred = torch.ones(vocab, dtype=torch.bool, device=device)
            barred.index_fill_(0, upload_list(p.allowed_token_ids, torch.long, device), False)
        return cls(counts, prompt, ids, bias, barred)


@dataclass(slots=True)
class Penalized:
    """The penalized rows of one step's batch."""

    rows: list[int]
    seqs: list[Sequence]
    index: torch.Tensor | None  # the rows on the device; None when they are the whole batch

    @classmethod
    def of(cls, logits: torch.Tensor, seqs: list[Sequence]) -> Penalized | None:
        rows = [i for i, s in enumerate(seqs) if s.sampling.penalized]
        if not rows:
            return None
        mine = [seqs[i] for i in rows]
        for s in mine:
            if s.seen is None:
                s.seen = Seen.of(s, logits.shape[-1], logits.device)
        index = None if len(rows) == len(seqs) else upload_list(rows, torch.long, logits.device)
        return cls(rows, mine, index)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """New logits [S, V] with the penalized rows changed; `logits` stays raw."""
        sub = logits.clone() if self.index is None else logits.index_select(0, self.index)
        for j, s in enumerate(self.seqs):
            if s.seen.bias is not None:
                sub[j].index_add_(0, s.seen.bias_ids, s.seen.bias)
            if s.seen.barred is not None:
                sub[j].masked_fill_(s.seen.barred, float("-inf"))
            if s.bad and (ban := banned(s.bad, s.out)):  # the host has every token (lookahead.eligible)
                sub[j].index_fill_(0, upload_list(ban, torch.long, logits.device), float("-inf"))
        params = [s.sampling for s in self.seqs]
        rep = [p.repetition_penalty for p in params]
        fp = [(p.frequency_penalty, p.presence_penalty) for p in params]
        repeat, openai = any(r != 1.0 for r in rep), any(f or p for f, p in fp)
        if repeat or openai:
            counts = torch.stack([s.seen.counts for s in self.seqs])
            generated = counts > 0
            if repeat:
                seen = generated.clone()
                for j, s in enumerate(self.seqs):
                    if s.seen.prompt is not None:
                        seen[j] |= s.seen.prompt
                factor = torch.where(seen, upload_list(rep, torch.float32, logits.device)[:, None], 1.0)
                sub = torch.where(sub > 0, sub / factor, sub * factor)
            if openai:
                k = upload_list(fp, torch.float32, logits.device)
                sub -= k[:, :1] * counts
                sub -= k[:, 1:] * generated
        return sub if self.index is None else logits.index_copy(0, self.index, sub)

    def count(self, chosen: torch.Tensor) -> None:
        """Add each penalized row's chosen token (ids [S] on the device) to its counts."""
        one = torch.ones(1, dtype=torch.int32, device=chosen.device)
        for i, s in zip(self.rows, self.seqs):
            s.seen.counts.index_add_(0, chosen[i:i + 1], one)
