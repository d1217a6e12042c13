"""Prompts pooled into vectors (backend/pooling.py): what `/v1/embeddings` answers with
and what the scores of `/score` and `/rerank` compare.

A call's prompts start in one group, outside any round: the engine prefills them
together, exactly (`prefix` mode at most, never by reuse), its prefix cache the API
key's (within `cache_salt`). A prompt may fill the whole context: no token is generated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from msgspec import Struct

from tokendance.backend.api import BackendError, InvalidRequest, Pooling, Request, SamplingParams, Segment
from tokendance.backend.protocol import Stream

from .core import Proxy
from .errors import ApiError, from_backend, invalid, unsupported
from .schemas import answer_id, truncation


class Fields(Struct, kw_only=True):
    """The fields every vLLM pooling request takes."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # a text-only model's processor takes none
    use_activation: bool | None = None  # normalize the vectors (default true)


@dataclass(slots=True)
class Shape:
    """How a call's prompts become requests, as vLLM's pooling fields say."""

    tenant: str
    special: bool  # add_special_tokens
    truncate: int | None = None  # truncate_prompt_tokens, resolved
    side: str = "right"  # truncation_side: a pooling model keeps the first tokens (vLLM's default)
    normalize: bool = True  # use_activation
    priority: int = 0  # vLLM's, under the engine's --scheduling-policy priority


def shape(px: Proxy, body: Fields, headers: Mapping[str, str], special: bool) -> tuple[str, Shape]:
    """The call's id (after its prefix) and its prompts' shape; a 400 for what cannot be."""
    if body.model is not None:
        px.served(body.model)
    if body.padding == "max_length":
        raise unsupported("padding", "padding to max_length (for encoders trained on fixed lengths)")
    if body.mm_processor_kwargs:
        raise invalid("this model takes text only: it has no multimodal processor", "mm_processor_kwargs")
    key = answer_id(body.request_id, headers.get("X-Request-Id"))
    truncate = truncation(body.truncate_prompt_tokens, px.backend.info.max_model_len)
    normalize = body.use_activation if body.use_activation is not None else True
    return key, Shape(px.tenant(headers, body.cache_salt), special, truncate, body.truncation_side or "right",
                      normalize, body.priority)


@dataclass(slots=True)
class Pooled:
    vectors: list[list[float]]
    tokens: list[int]  # each prompt's length in tokens


async def pool(px: Proxy, key: str, prompts: list[str | list[int]], shape: Shape, field: str) -> Pooled:
    """Every prompt's vector, in their order; a bad prompt is a 400 naming `field`."""
    group = []
    for i, p in enumerate(prompts):
        text = isinstance(p, str)
        sampling = SamplingParams(max_tokens=1, priority=shape.priority)
        r = Request(f"{key}-{i}", [Segment(p)] if text else [], sampling, prompt_token_ids=None if text else p,
                    tenant=shape.tenant, add_special_tokens=shape.special, truncate=shape.truncate,
                    truncation_side=shape.side, pooling=Pooling(shape.normalize), whole=True)
        try:
            px.admitted(key, "pooling", group, r)
        except InvalidRequest as exc:
            raise _named(exc, field) from None
    streams = px.generate(group)
    try:
        vectors = await asyncio.gather(*(_vector(s, field) for s in streams))
    finally:  # a client gone, or another prompt failed: nothing keeps running
        for s in streams:
            s.abort()
    tokens = [p.prompt_tokens for p in group]
    px.metrics.tokens.inc(sum(tokens), kind="prompt")
    return Pooled(list(vectors), tokens)


async def _vector(stream: Stream, field: str) -> list[float]:
    try:
        async for d in stream:
            if d.embedding is not None:
                return d.embedding
    except InvalidRequest as exc:
        raise _named(exc, field) from None
    except BackendError as exc:
        raise from_backend(exc) from exc
    raise from_backend(BackendError("the backend ended an embedding without its vector"))


def _named(exc: InvalidRequest, field: str) -> ApiError:
    """A backend's refusal as a 400 naming the prompt's `field` where it names a prompt
    (the engine names a chat's)."""
    return invalid(exc.message, field if exc.param in (None, "messages", "prompt") else exc.param, exc.code)
