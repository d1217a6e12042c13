"""vLLM's beam search (`use_beam_search`), as vLLM's server runs it: over the backend's
own requests, one token each. At every step each live beam's tokens go to the backend as
a prompt, in `prefix` mode (exact; the beams share their prompt's blocks and their common
past through the prefix cache), with the 2n likeliest next tokens asked for; of every
beam's continuations the n best by score live on, and a continuation by an end token (the
model's EOS unless `ignore_eos`, a `stop_token_ids` one, neither before `min_tokens`)
is kept aside as finished. After `max_tokens` steps (or once no beam is left) the n best
of the finished and the live are the n choices, best first.

A beam's score is its cumulative log-probability over (prompt + output tokens, its end
token left out) ** length_penalty, vLLM's. Candidates are ranked by the model's own
log-probabilities, so temperature, top_p, top_k, min_p and seed change nothing, as in vLLM.
With `logprobs`, each choice's tokens come with their log-probabilities and the k best
alternatives at each step, as the steps gave them. A beam search is not part of a round:
it is refused in a session."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from tokendance.backend.api import (TOP_LOGPROBS, Delta, InvalidRequest, Prepared, Request, SamplingParams,
                                    TokenLogprob, TopLogprob, Usage)
from tokendance.backend.protocol import Backend, Stream

from .errors import invalid, unsupported

MAX_WIDTH = TOP_LOGPROBS // 2  # each step asks for 2n alternatives


@dataclass(slots=True, frozen=True)
class Beams:
    width: int  # the request's n
    length_penalty: float = 1.0


@dataclass(slots=True)
class Beam:
    tokens: list[int]  # its output so far, its end token aside
    logprob: float = 0.0  # cumulative
    end: int | None = None  # the end token that finished it
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with `logprobs`: each token's, the end's too

    def rank(self, prompt: int, penalty: float) -> tuple[float, float]:
        """Orders beams as vLLM's score, logprob / (prompt + len(tokens)) ** penalty, does
        (logprobs are not positive), in logs and scaled down by a penalty above 1, so that
        none overflows; then, where that rounds alike, by logprob."""
        if self.logprob >= 0.0:
            return math.inf, self.logprob
        s = max(1.0, abs(penalty))
        return penalty / s * math.log(prompt + len(self.tokens)) - math.log(-self.logprob) / s, self.logprob


# What changes the logits a beam is ranked by, reads the prompt's or chosen tokens', or
# ends a beam by its text: no place in a beam search (a 400 each, naming the field),
# unless left at a value that asks for nothing.
REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "stop": ("stop strings", ("", [])), "prompt_logprobs": ("prompt_logprobs", ()),
    "logprob_token_ids": ("logprob_token_ids", ([],)),
    "response_format": ("structured outputs", ()), "structured_outputs": ("structured outputs", ()),
    "presence_penalty": ("penalties", (0.0,)), "frequency_penalty": ("penalties", (0.0,)),
    "repetition_penalty": ("penalties", (1.0,)), "logit_bias": ("logit_bias", ({},)),
    "allowed_token_ids": ("allowed_token_ids", ()), "bad_words": ("bad_words", ([],)),
    "repetition_detection": ("repetition_detection", ()), "thinking_token_budget": ("a thinking budget", (-1,)),
}


def _unset(value: Any, neutral: tuple[Any, ...]) -> bool:
    """None, or one of `neutral` of its own type (0 is not False)."""
    return value is None or any(type(value) is type(v) and value == v for v in neutral)


def asked(body: Any, backend: Backend, session: str | None) -> Beams | None:
    """The request's beam search, checked; None when it asks for none."""
    if not body.use_beam_search:
        return None
    if not 1 <= body.n <= MAX_WIDTH:
        raise invalid(f"n is the beam width: between 1 and {MAX_WIDTH} with use_beam_search", "n")
    if not math.isfinite(body.length_penalty):
        raise invalid("length_penalty must be a finite number", "length_penalty")
    for name, (what, neutral) in REFUSED.items():
        value = getattr(body, name, None)
        if name == "response_format" and getattr(value, "type", None) == "text":
            continue
        if not _unset(value, neutral):
            raise unsupported(name, f"{what} with use_beam_search")
    if getattr(body, "echo", False) and getattr(body, "logprobs", None) is not None:
        raise unsupported("echo", "the prompt's logprobs (echo with logprobs) with use_beam_search")
    if session is not None:
        raise invalid("a beam search is not part of a round: leave out the session with use_beam_search",
                      "use_beam_search")
    if getattr(backend, "tokenizer", None) is None:
        raise unsupported("use_beam_search", "beam search through a backend without a tokenizer")
    return Beams(body.n, body.length_penalty)


def start(backend: Backend, prepared: list[Prepared], beams: Beams, key: str) -> list[Stream]:
    """n streams per prompt (prepared holds each prompt n times), each giving its beam
    whole, in one delta, once the prompt's search ends."""
    out: list[Stream] = []
    for k in range(0, len(prepared), beams.width):
        s = Search(backend, prepared[k], beams, f"{key}-beam{k}")
        out += [Choice(s, i) for i in range(beams.width)]
    return out


@dataclass(eq=False)
class Search:
    backend: Backend
    first: Prepared
    beams: Beams
    key: str
    usage: Usage = field(default_factory=Usage)  # the prompt's, from the first step
    left: int = 0  # choices still read
    task: asyncio.Task = field(init=False)

    def __post_init__(self) -> None:
        if self.first.ids is None:
            raise invalid("beam search needs the prompt's token ids, which this backend does not give",
                          "use_beam_search", "unsupported")
        self.left = self.beams.width
        self.task = asyncio.create_task(self.run())

    async def run(self) -> list[Beam]:
        sp, prompt = self.first.request.sampling, self.first.ids
        ends = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.backend.info.eos))
        width, rank = self.beams.width, self.rank
        k = sp.top_logprobs if sp.logprobs else 0  # the alternatives a choice lists at each token
        step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=max(2 * width, k),
                              ignore_eos=True, priority=sp.priority)
        live, done = [Beam([])], []
        for t in range(sp.max_tokens):
            tops = await self.step(t, [prompt + b.tokens for b in live], step)
            grown = []
            for b, top in zip(live, tops):
                for x in top[:2 * width]:
                    lps = b.logprobs + [TokenLogprob(x.token, x.logprob, x.bytes, top=top[:k], id=x.id)
                                        ] if sp.logprobs else []
                    if x.id not in ends:
                        grown.append(Beam(b.tokens + [x.id], b.logprob + x.logprob, None, lps))
                    elif len(b.tokens) >= sp.min_tokens:  # an end before min_tokens is barred
                        done.append(Beam(b.tokens, b.logprob + x.logprob, x.id, lps))
            live = sorted(grown, key=rank, reverse=True)[:width]
            if not live or len(prompt) + t + 2 > self.backend.info.max_model_len:
                break
        best = sorted(done + live, key=rank, reverse=True)[:width]
        if len(best) < width:
            raise InvalidRequest(f"the model gives {len(best)} beams, fewer than n ({width})", "n")
        return best

    def rank(self, b: Beam) -> tuple[float, float]:
        return b.rank(len(self.first.ids), self.beams.length_penalty)

    async def step(self, t: int, prompts: list[list[int]], sp: SamplingParams) -> list[list[TopLogprob]]:
        """Each prompt's likeliest next tokens and their logprobs, best first, from one group."""
        r = self.first.request
        group = [self.backend.prepare(Request(f"{self.key}-{t}-{j}", [], sp, mode="prefix", prompt_token_ids=p,
                                              tenant=r.tenant, route=self.key, whole=True))
                 for j, p in enumerate(prompts)]
        streams = self.backend.generate(group)
        try:
            got = await asyncio.gather(*(_last(s) for s in streams))
        finally:
            for s in streams:  # all ended, unless this search was cancelled or one failed
                s.abort()
        if t == 0 and got[0].usage is not None:
            self.usage = got[0].usage
        out = []
        for d in got:
            top = d.logprobs[-1].top if d.logprobs else []
            if any(x.id is None for x in top):
                raise InvalidRequest("beam search needs the backend to name its logprobs' tokens by id, "
                                     "which this one does not", "use_beam_search", "unsupported")
            out.append(sorted(top, key=lambda x: -x.logprob))  # best first, whatever order they came in
        return out

    def delta(self, i: int, beams: list[Beam]) -> Delta:
        b, sp = beams[i], self.first.request.sampling
        text = self.backend.tokenizer.decode(b.tokens, skip_special_tokens=sp.skip_special_tokens)
        ids = b.tokens + ([b.end] if b.end is not None else [])
        u = self.usage
        usage = Usage(prompt_tokens=u.prompt_tokens or self.first.prompt_tokens, completion_tokens=len(ids),
                      cached_tokens=u.cached_tokens)
        stop = b.end if b.end in sp.stop_token_ids else None
        return Delta(text=text, token_ids=ids, finish_reason="length" if b.end is None else "stop",
                     stop_reason=stop, usage=usage, logprobs=b.logprobs)

    def leave(self) -> None:
        """A choice is no longer read: the search stops once none is."""
        self.left -= 1
        if self.left == 0:
            self.task.cancel()


async def _last(stream: Stream) -> Delta:
    """A one-token request's answer, its deltas merged."""
    d = Delta()
    async for x in stream:
        d.logprobs += x.logprobs
        d.usage = x.usage or d.usage
    return d


@dataclass(eq=False)
class Choice:
    """The i-th best beam of a search, as a stream."""

    search: Search
    i: int
    gone: bool = False

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Delta]:
        try:
            beams = await asyncio.shield(self.search.task)
        except BaseException:
            self.abort()
            raise
        self.abort()  # read: nothing of the search is needed any longer
        yield self.search.delta(self.i, beams)

    def abort(self) -> None:
        if not self.gone:
            self.gone = True
            self.search.leave()
