"""OpenAI's `/v1/embeddings`, as vLLM serves it for a generative model converted to
embeddings: each input's last token's final hidden state, normalized to unit length
(backend/pooling.py). Agents' memories (retrieval by similarity) can then use the same
server and model as their chats.

Inputs are strings, or token ids (one prompt as a list of ints, several as a list of
lists), or, as vLLM takes them, a chat's `messages` rendered by the model's template
(without the generation prompt unless asked). Every input of a call starts in one group,
outside any round: the engine prefills them together, exactly (`prefix` mode at most:
never by reuse), its prefix cache the API key's (within `cache_salt`). A prompt may fill
the whole context: no token is generated. vLLM's `truncate_prompt_tokens`,
`add_special_tokens` (default true for `input`, false for `messages`, as vLLM's),
`normalize` (or its newer name, `use_activation`) and `request_id` are taken;
`dimensions` is a 400, as vLLM answers it for a model without Matryoshka training.
"""

from __future__ import annotations

import asyncio
import struct
import time
from base64 import b64encode
from collections.abc import Mapping
from typing import Any

from msgspec import Struct

from tokendance.backend.api import BackendError, InvalidRequest, Pooling, Request, SamplingParams, Segment, Stream

from . import schemas
from .core import Proxy
from .errors import ApiError, from_backend, invalid, unsupported
from .schemas import Message, answer_id, truncation

MAX_INPUTS = 2048  # OpenAI's limit on one call's inputs


class EmbeddingRequest(Struct, kw_only=True):
    input: str | list[str | int | list[int]] | None = None
    messages: list[Message] | None = None  # vLLM's chat form, instead of input
    model: str | None = None
    encoding_format: str = "float"  # or "base64": little-endian float32s (the openai SDK's default)
    dimensions: int | None = None
    user: str | None = None
    # vLLM's
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None  # default: true for input, false for messages
    normalize: bool | None = None  # default true
    use_activation: bool | None = None  # newer vLLM's name for normalize
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class Embedding(Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Struct):
    id: str
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
    object: str = "list"


def inputs(px: Proxy, body: EmbeddingRequest) -> list[str | list[int]]:
    """The call's prompts: texts, or token id lists."""
    if (body.input is None) == (body.messages is None):
        raise invalid("give either input or messages", "input")
    if body.messages is not None:
        return [_chat(px, body)]
    x = body.input
    if isinstance(x, str):
        x = [x]
    if not x:
        raise invalid("input must not be empty", "input")
    if all(isinstance(i, int) for i in x):
        return [x]  # one prompt of token ids
    if len(x) > MAX_INPUTS:
        raise invalid(f"input holds {len(x)} inputs; at most {MAX_INPUTS} per request", "input")
    if all(isinstance(i, str) for i in x):
        if not all(x):
            raise invalid("input must not hold empty strings", "input")
        return x
    if all(isinstance(i, list) for i in x):
        if not all(x):
            raise invalid("input must not hold empty token lists", "input")
        return x
    raise invalid("input must be a string, a list of strings, a list of token ids or a list of "
                  "token id lists, not a mix", "input")


def _chat(px: Proxy, body: EmbeddingRequest) -> str:
    """The messages as the model's chat template renders them."""
    if not body.messages:
        raise invalid("messages must not be empty", "messages")
    template = schemas.template(body.chat_template_kwargs, body.add_generation_prompt, body.continue_final_message)
    messages, render = px.chat_form([schemas.message(i, m) for i, m in enumerate(body.messages)], None, template)
    return render(messages)


def check(body: EmbeddingRequest) -> None:
    if body.encoding_format not in ("float", "base64"):
        raise invalid(f"encoding_format must be float or base64, not {body.encoding_format!r}", "encoding_format")
    if body.dimensions is not None:
        raise invalid("this model does not support Matryoshka representations: dimensions cannot "
                      "change its embeddings' size", "dimensions")
    if body.priority:
        raise unsupported("priority", "priority other than 0 (first come, first served here)")


async def embed(px: Proxy, body: EmbeddingRequest, headers: Mapping[str, str]) -> EmbeddingList:
    """Every input embedded, in their order."""
    if body.model is not None:
        px.served(body.model)
    check(body)
    prompts = inputs(px, body)
    key = answer_id(body.request_id, headers.get("X-Request-Id"))
    tenant = px.tenant(headers, body.cache_salt)
    truncate = truncation(body.truncate_prompt_tokens, px.backend.info.max_model_len)
    special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
    pool = Pooling(next((x for x in (body.use_activation, body.normalize) if x is not None), True))
    field = "input" if body.messages is None else "messages"
    group = []
    for i, p in enumerate(prompts):
        text = isinstance(p, str)
        r = Request(f"embd-{key}-{i}", [Segment(p)] if text else [], SamplingParams(max_tokens=1),
                    prompt_token_ids=None if text else p, tenant=tenant, add_special_tokens=special,
                    truncate=truncate, pooling=pool)
        try:
            group.append(px.backend.prepare(r))
        except InvalidRequest as exc:
            raise _named(exc, field) from None
    streams = px.generate(group)
    try:
        vectors = await asyncio.gather(*(_vector(s, field) for s in streams))
    finally:  # a client gone, or another input failed: nothing keeps running
        for s in streams:
            s.abort()
    used = sum(p.prompt_tokens for p in group)
    px.metrics.tokens.inc(used, kind="prompt")
    data = [Embedding(i, _encoded(v, body.encoding_format)) for i, v in enumerate(vectors)]
    return EmbeddingList(f"embd-{key}", int(time.time()), px.names[0], data, EmbeddingUsage(used, used))


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


def _encoded(v: list[float], fmt: str) -> list[float] | str:
    return b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if fmt == "base64" else v
