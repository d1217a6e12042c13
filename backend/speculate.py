"""N-gram speculation, vLLM's `--speculative-config '{"method": "ngram", ...}'`.

A decoding request proposes the tokens that followed the earliest earlier occurrence of
its last n tokens (n from prompt_lookup_max down to prompt_lookup_min, the longest match
first, as vLLM's proposer does: backend/ngram.py); its next step feeds them after its last token, one
forward for all, and keeps the longest prefix the model agrees with plus the model's own
next token. Agents of a round quote each other, and each prompt holds the others' last
answers: what a lookup over the request's own tokens finds, with no draft model.

The output keeps its distribution. A greedy request keeps the tokens it would decode one
at a time (up to float rounding: the drafts' rows are computed in one product); a sampled
one accepts a draft token with the probability the model gives it and, on a rejection,
draws from the rest (speculative sampling where the draft has probability one).

Requests whose next token depends on the tokens before it being known on the host one by
one decode a token a step: penalties (and logit bias, allowed ids), a grammar, bad words,
a thinking budget, ends barred by min_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tokendance.backend.api import InvalidRequest
from tokendance.backend.ngram import Speculation, propose
from tokendance.backend.sampler import Sampled, attach, draw, probabilities, sample
from tokendance.backend.sequence import Sequence
from tokendance.backend.upload import upload_list

if TYPE_CHECKING:
    from tokendance.backend.scheduler import Scheduled


def eligible(seq: Sequence) -> bool:
    """Whether a request's next tokens may be drafted (see the module's last paragraph)."""
    p = seq.sampling
    return not (p.penalized or seq.matcher is not None or seq.until or seq.bad or seq.thought is not None
                or len(seq.out) < p.min_tokens or seq.pooling is not None)


@dataclass(slots=True)
class Speculator:
    spec: Speculation
    drafts: int = 0  # steps a request took with drafts (vLLM's num_drafts)
    draft_tokens: int = 0
    accepted: int = 0

    @classmethod
    def of(cls, config: dict[str, Any] | None, overlap: bool | None) -> Speculator | None:
        """From EngineConfig.speculative_config (None: off); overlap (backend/lookahead.py) lands a
        step's tokens after the next step is scheduled, when they are needed to draft."""
        spec = Speculation.parse(config)
        if spec is not None and overlap:
            raise InvalidRequest("speculative_config: not with overlap (drafts are read from the tokens "
                                 "the last step sampled)", "overlap")
        return None if spec is None else cls(spec)

    def draft(self, running: list[Sequence], max_model_len: int) -> None:
        """Each decoding request's drafts for the next step (the scheduler feeds them after its
        last token, or fewer when the step's budget is short)."""
        for s in running:
            s.draft = []
            if s.pending == 1 and eligible(s):
                room = min(max_model_len - len(s), s.sampling.max_tokens - len(s.out)) - 1
                s.draft = propose(s.tokens, self.spec, room)

    def picks(self, logits: torch.Tensor, work: list[Scheduled], default: torch.Generator | None
              ) -> list[tuple[Sequence, list[Sampled]]]:
        """The tokens each sampling request of the step takes, in order: one without drafts
        (sampler.sample), its accepted drafts and the model's next with them (`verify`).
        `logits`: rows in `work`'s order, 1 + drafts each (runner.step_meta)."""
        ready = [w for w in work if w.samples]
        at = [0]
        for w in ready:
            del w.seq.draft[w.drafts:]  # what the step's token budget let in
            at.append(at[-1] + 1 + w.drafts)
        one = [i for i, w in enumerate(ready) if not w.drafts]
        more = [i for i, w in enumerate(ready) if w.drafts]
        out: list[tuple[Sequence, list[Sampled]]] = []
        if one:
            seqs = [ready[i].seq for i in one]
            rows = logits if not more else logits[upload_list([at[i] for i in one], torch.long, logits.device)]
            out += [(s, [p]) for s, p in zip(seqs, sample(rows, seqs, default))]
        if more:
            seqs = [ready[i].seq for i in more]
            rows = [r for i in more for r in range(at[i], at[i + 1])]
            got = verify(logits[upload_list(rows, torch.long, logits.device)], seqs, default)
            self.drafts += len(seqs)
            self.draft_tokens += sum(len(s.draft) for s in seqs)
            self.accepted += sum(len(p) - 1 for p in got)
            out += list(zip(seqs, got))
            for s in seqs:
                s.draft = []
        return out


def verify(logits: torch.Tensor, seqs: list[Sequence], default: torch.Generator | None) -> list[list[Sampled]]:
    """Per sequence, its accepted drafts then the model's own next token. `logits`: each
    sequence's 1 + len(draft) rows in order, the first scoring its last token."""
    sizes = [1 + len(s.draft) for s in seqs]
    params = [s.sampling for s, n in zip(seqs, sizes) for _ in range(n)]
    dev = logits.device
    drafted = upload_list([t for s in seqs for t in s.draft + [-1]], torch.long, dev)  # -1: the last row
    best = logits.argmax(-1)
    if all(p.greedy for p in params):
        accept, token = best == drafted, best
    else:
        probs = probabilities(logits, params)
        owners = [s for s, n in zip(seqs, sizes) for _ in range(n)]  # each row's sequence
        u = torch.rand(len(params), generator=default, device=dev)
        r = 0
        for s, n in zip(seqs, sizes):
            if s.generator is not None and not s.sampling.greedy:
                u[r:r + n] = torch.rand(n, generator=s.generator, device=dev)
            r += n
        mine = drafted.clamp_min(0)[:, None]
        likely = probs.gather(-1, mine)[:, 0]
        # a rejected draft's row draws from the rest; the last row from all of it
        rest = probs.scatter(-1, mine, (drafted < 0).to(probs.dtype)[:, None] * likely[:, None])
        greedy = upload_list([p.greedy for p in params], torch.bool, dev)
        accept = torch.where(greedy, best == drafted, u < likely) & (drafted >= 0)
        token = draw(rest, owners, default, best)
    ok, tok = torch.stack([accept.long(), token]).tolist()
    out: list[list[Sampled]] = []
    rows: list[int] = []
    r = 0
    for s, n in zip(seqs, sizes):
        j = 0
        while j < n - 1 and ok[r + j]:
            j += 1
        out.append([Sampled(t) for t in s.draft[:j]] + [Sampled(tok[r + j])])
        rows += range(r, r + j + 1)
        r += n
    if any(p.logprobs for p in params):
        flat = [p for picks in out for p in picks]
        index = upload_list(rows, torch.long, dev)
        attach(flat, logits[index], [params[i] for i in rows], upload_list([p.token for p in flat], torch.long, dev))
    return out
