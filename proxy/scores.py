"""vLLM's `/score` and `/rerank` (Jina's and Cohere's rerank API), as vLLM serves them
for an embedding model (a bi-encoder): each query and document embedded once
(proxy/pooled.py) and each pair scored by the cosine of their vectors. An agent can rank
its memories against what it perceives in one call.

`/score` pairs its two lists 1:1, one query against every document (1:N), or pair by
pair (N:N); its lists come as vLLM names them: `queries` with `documents` (or `items`),
`data_1` with `data_2`, or `text_1` with `text_2`. `/rerank` scores one `query` against
its `documents` and answers them best first, the top `top_n` (0: all). vLLM's
`max_tokens_per_query` and `max_tokens_per_doc` cut texts to that many tokens; the
pooling fields (proxy/pooled.py) apply to every text. `instruction` and
`chat_template_kwargs` feed a cross-encoder's score template, which an embedding model
has none of: they are taken and change nothing, as in vLLM.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from operator import mul
from typing import Any

from msgspec import UNSET, Struct, UnsetType

from .core import Proxy
from .errors import invalid
from .pooled import Fields, pool, shape

PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class Scoring(Fields, kw_only=True):
    max_tokens_per_query: int = 0
    max_tokens_per_doc: int = 0
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ScoreRequest(Scoring, kw_only=True):
    queries: Any = None
    documents: Any = None
    items: Any = None
    data_1: Any = None
    data_2: Any = None
    text_1: Any = None
    text_2: Any = None


class RerankRequest(Scoring, kw_only=True):
    query: Any = None
    documents: Any = None
    top_n: int = 0


class Cached(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: Cached | UnsetType = UNSET  # a generative score's: prompt tokens whose KV was reused


class Score(Struct):
    index: int
    score: float
    object: str = "score"


class ScoreList(Struct):
    id: str
    created: int
    model: str
    data: list[Score]
    usage: Usage
    object: str = "list"


class Document(Struct):
    text: str
    multi_modal: None = None


class Ranked(Struct):
    index: int
    document: Document
    relevance_score: float


class RerankUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class Reranked(Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[Ranked]


def texts(x: Any, field: str) -> list[str]:
    """A text or a list of texts; a 400 for anything else (a multimodal part most of all)."""
    if x is None:
        raise invalid(f"{field} is required", field)
    xs = [x] if isinstance(x, str) else x
    if not isinstance(xs, list) or not all(isinstance(t, str) for t in xs):
        raise invalid(f"{field} must be a text or a list of texts (this model takes text only)", field)
    if not xs:
        raise invalid(f"{field} must not be empty", field)
    if not all(xs):
        raise invalid(f"{field} must not hold empty texts", field)
    return xs


def _pair(body: ScoreRequest) -> tuple[str, str]:
    named = {n for p in PAIRS for n in p if getattr(body, n) is not None}
    fits = [p for p in PAIRS if named <= set(p)]
    if not named or not fits:
        raise invalid("give one pair of lists: queries and documents (or items), data_1 and data_2, or "
                      "text_1 and text_2", "queries")
    return fits[0]


def _cut(px: Proxy, xs: list[str], n: int, field: str) -> list[str]:
    """Each text cut to its first `n` tokens (0: whole), at a character boundary of its
    tokens, so that it tokenizes to at most `n` again (tokens can merge across a cut)."""
    if n < 0 or n >= px.backend.info.max_model_len:
        raise invalid(f"{field} must be between 0 and the context's {px.backend.info.max_model_len - 1} tokens, "
                      f"not {n}", field)
    if n == 0:
        return xs
    tok = px.backend.tokenizer
    if tok is None:
        raise invalid(f"the {px.backend.info.name} backend has no tokenizer to cut texts with", field)
    out = []
    for text in xs:
        while True:
            got = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            marks = got["offset_mapping"]
            if len(marks) <= n:
                break
            text = text[:min(marks[n - 1][1], marks[n][0], len(text) - 1)]
        out.append(text)
    return out


async def _scores(px: Proxy, body: Scoring, headers: Mapping[str, str], one: list[str], two: list[str],
                  fields: tuple[str, str]) -> tuple[str, list[float], int]:
    """The call's id (after its prefix), each pair's cosine and the tokens read."""
    if len(one) > 1 and len(one) != len(two):
        raise invalid(f"{fields[0]} holds {len(one)} texts and {fields[1]} {len(two)}: pair them 1:1, 1:N or N:N",
                      fields[0])
    one = _cut(px, one, body.max_tokens_per_query, "max_tokens_per_query")
    two = _cut(px, two, body.max_tokens_per_doc, "max_tokens_per_doc")
    key, how = shape(px, body, headers, special=True)
    got = await pool(px, f"score-{key}", [*one, *two], how, fields[1])
    left, right = got.vectors[:len(one)], got.vectors[len(one):]
    if len(left) == 1:
        left = left * len(right)
    return key, [cosine(a, b) for a, b in zip(left, right)], sum(got.tokens)


def cosine(a: list[float], b: list[float]) -> float:
    return sum(map(mul, a, b)) / (max(math.hypot(*a), 1e-8) * max(math.hypot(*b), 1e-8))


async def score(px: Proxy, body: ScoreRequest, headers: Mapping[str, str]) -> ScoreList:
    f1, f2 = _pair(body)
    one, two = texts(getattr(body, f1), f1), texts(getattr(body, f2), f2)
    key, scores, used = await _scores(px, body, headers, one, two, (f1, f2))
    return ScoreList(f"score-{key}", int(time.time()), px.names[0], [Score(i, s) for i, s in enumerate(scores)],
                     Usage(used, used))


async def rerank(px: Proxy, body: RerankRequest, headers: Mapping[str, str]) -> Reranked:
    if body.query is not None and not isinstance(body.query, str):
        raise invalid("query must be a text", "query")
    if body.top_n < 0:
        raise invalid(f"top_n must be at least 0, not {body.top_n}", "top_n")
    docs = texts(body.documents, "documents")
    key, scores, used = await _scores(px, body, headers, texts(body.query, "query"), docs, ("query", "documents"))
    ranked = sorted((Ranked(i, Document(d), s) for i, (d, s) in enumerate(zip(docs, scores))),
                    key=lambda r: -r.relevance_score)
    return Reranked(f"score-{key}", px.names[0], RerankUsage(used, used), ranked[:body.top_n or len(docs)])
