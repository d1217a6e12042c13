"""vLLM's `/generative_scoring`: a generative model as a judge. Each item is scored by the
probability of the first label token as the next token after the query and the item:
`label_token_ids` (say the ids of " Yes" and " No") read in one step, as vLLM reads them
(`logprob_token_ids`), softmaxed over the labels alone (`apply_softmax`, the default) or
the model's own probability over its whole vocabulary.

Every item goes to the engine at once, in one group; each prompt is the query's tokens
then the item's (`item_first`: the other way round), cut to the context less the one
token it reads. The query is tokenized with the tokenizer's special tokens
(`add_special_tokens`), an item without, as vLLM does; token ids are taken as given.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping

from msgspec import Struct

from tokendance.backend.api import LABELS, BackendError, InvalidRequest, Request, SamplingParams
from tokendance.backend.protocol import Stream

from .core import Proxy
from .embeddings import MAX_INPUTS
from .errors import from_backend, invalid
from .schemas import answer_id
from .scores import Cached, Score, ScoreList, Usage


class GenerativeScoring(Struct, kw_only=True):
    query: str | list[int]
    items: list[str | list[int]]
    label_token_ids: list[int]
    apply_softmax: bool = True
    item_first: bool = False
    add_special_tokens: bool = True
    model: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None


def _prompts(px: Proxy, body: GenerativeScoring) -> list[list[int]]:
    """Each item's prompt in token ids; a 400 for what cannot be one."""
    if not 1 <= len(body.items) <= MAX_INPUTS:
        raise invalid(f"items must hold between 1 and {MAX_INPUTS} items, not {len(body.items)}", "items")
    if len({isinstance(x, str) for x in body.items}) > 1:
        raise invalid("items must be all texts or all token id lists, not both", "items")
    tok = getattr(px.backend, "tokenizer", None)
    if tok is None and (isinstance(body.query, str) or isinstance(body.items[0], str)):
        raise invalid(f"the {px.backend.info.name} backend has no tokenizer: give token ids", "query")
    query = tok.encode(body.query, add_special_tokens=body.add_special_tokens) if isinstance(body.query, str) \
        else body.query
    room = px.backend.info.max_model_len - 1
    out = []
    for i, item in enumerate(body.items):
        ids = tok.encode(item, add_special_tokens=False) if isinstance(item, str) else item
        if not ids and not query:
            raise invalid(f"item {i} and the query are both empty: nothing to read a next token after", "items")
        out.append((ids + query if body.item_first else query + ids)[:room])
    return out


async def score(px: Proxy, body: GenerativeScoring, headers: Mapping[str, str]) -> ScoreList:
    if body.model is not None:
        px.served(body.model)
    labels = list(dict.fromkeys(body.label_token_ids))
    if not 1 <= len(labels) <= LABELS:
        raise invalid(f"label_token_ids must name between 1 and {LABELS} tokens", "label_token_ids")
    key = answer_id(body.request_id, headers.get("X-Request-Id"))
    tenant = px.tenant(headers, body.cache_salt)
    sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, logprob_token_ids=labels,
                              priority=body.priority)
    group = []
    for i, ids in enumerate(_prompts(px, body)):
        try:
            group.append(px.backend.prepare(Request(f"generative-scoring-{key}-{i}", [], sampling,
                                                    prompt_token_ids=ids, tenant=tenant, whole=True)))
        except InvalidRequest as exc:
            raise _named(exc) from None
    streams = px.generate(group)
    try:
        reads = await asyncio.gather(*(_read(s) for s in streams))
    finally:  # a client gone, or another item failed: nothing keeps running
        for s in streams:
            s.abort()
    prompt = sum(p.prompt_tokens for p in group)
    px.metrics.tokens.inc(prompt, kind="prompt")
    px.metrics.tokens.inc(len(group), kind="completion")
    data = [Score(i, _probability(got, labels, body.apply_softmax)) for i, (got, _) in enumerate(reads)]
    return ScoreList(f"generative-scoring-{key}", int(time.time()), px.names[0], data,
                     Usage(prompt, prompt + len(group), len(group), Cached(sum(c for _, c in reads))))


async def _read(stream: Stream) -> tuple[dict[int, float], int]:
    """The labels' logprobs at the one step the request takes, and its prompt tokens
    whose KV was reused."""
    got, cached = None, 0
    try:
        async for d in stream:
            if d.logprobs and got is None:
                got = {t.id: t.logprob for t in d.logprobs[0].top}
            if d.usage is not None:
                cached = d.usage.cached_tokens
    except InvalidRequest as exc:
        raise _named(exc) from None
    except BackendError as exc:
        raise from_backend(exc) from exc
    if got is None:
        raise from_backend(BackendError("the backend ended a read without its logprobs"))
    return got, cached


def _probability(got: dict[int, float], labels: list[int], softmax: bool) -> float:
    """The first label's probability: over the labels alone, or over the vocabulary."""
    if any(t not in got for t in labels):
        raise from_backend(BackendError(f"the backend left out label tokens {[t for t in labels if t not in got]}"))
    if not softmax:
        return math.exp(got[labels[0]])
    top = max(got[t] for t in labels)
    return math.exp(got[labels[0]] - top) / sum(math.exp(got[t] - top) for t in labels)


def _named(exc: InvalidRequest) -> Exception:
    """The engine's refusal, naming this API's fields."""
    param = {"logprob_token_ids": "label_token_ids", "prompt": "items"}.get(exc.param or "", exc.param)
    message = exc.message.replace("logprob_token_ids", "label_token_ids")
    return invalid(message, param, exc.code)
