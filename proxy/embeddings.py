"""OpenAI's `/v1/embeddings`, as vLLM serves it for a generative model converted to
embeddings: each input's last token's final hidden state, normalized to unit length
(backend/pooling.py, proxy/pooled.py). Agents' memories (retrieval by similarity) can
then use the same server and model as their chats.

Inputs are strings, or token ids (one prompt as a list of ints, several as a list of
lists), or, as vLLM takes them, chats rendered by the model's template (without the
generation prompt unless asked): one chat or a list of chats, in `messages` or in
`input`. vLLM's fields are taken: `truncate_prompt_tokens` with `truncation_side`
(a pooling model keeps the first tokens), `add_special_tokens` (default true for
`input`, false for chats), `use_activation`, `request_id`, `cache_salt`; and its
encodings: `encoding_format` float, base64, bytes or bytes_only, `embed_dtype` and
`endianness`. `dimensions` is a 400, as vLLM answers it for a model without Matryoshka
training; so is `normalize`, which vLLM no longer takes. vLLM's `/pooling` gives the same
vectors as pooling outputs (its `embed` task; the per-token and classifying tasks need
heads this model has not).
"""

from __future__ import annotations

import json
import struct
import sys
import time
from base64 import b64encode
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import msgspec
from aiohttp import web
from msgspec import Struct

from . import schemas
from .core import Proxy
from .errors import invalid
from .pooled import Fields, pool, shape
from .schemas import Message

MAX_INPUTS = 2048  # OpenAI's limit on one call's inputs
DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")  # vLLM's embed_dtype
ENDIANNESS = ("native", "big", "little")
FORMATS = ("float", "base64", "bytes", "bytes_only")


class EmbeddingRequest(Fields, kw_only=True):
    input: str | list[Any] | None = None
    messages: list[Any] | None = None  # vLLM's chat form: one chat, or a list of chats
    encoding_format: str = "float"  # base64: the openai SDK's default
    embed_dtype: str = "float32"
    endianness: str = "native"
    dimensions: int | None = None
    add_special_tokens: bool | None = None  # default: true for input, false for chats
    normalize: Any = None  # vLLM's old name for use_activation: refused, as vLLM refuses it
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: where the server trusts them (schemas.own)


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


class PoolingRequest(EmbeddingRequest, kw_only=True):
    task: str | None = None  # vLLM's pooling task: "embed", the one this model does


class PoolingData(Struct):
    index: int
    data: list[float] | str
    object: str = "pooling"


class PoolingList(EmbeddingList):
    data: list[PoolingData]


@dataclass(slots=True)
class Binary:
    """encoding_format bytes: the vectors back to back, and what the metadata header says."""

    body: bytes
    metadata: str | None  # None for bytes_only
    id: str

    def response(self) -> web.Response:
        resp = web.Response(body=self.body, content_type="application/octet-stream",
                            headers={"X-Request-Id": self.id})
        if self.metadata is not None:
            resp.headers["metadata"] = self.metadata
        return resp


def check(body: EmbeddingRequest) -> None:
    if body.normalize is not None:
        raise invalid("Parameter `normalize` was removed; use `use_activation` instead.", "normalize")
    if body.encoding_format not in FORMATS:
        raise invalid(f"encoding_format must be one of {', '.join(FORMATS)}, not {body.encoding_format!r}",
                      "encoding_format")
    if body.embed_dtype not in DTYPES:
        raise invalid(f"embed_dtype must be one of {', '.join(DTYPES)}, not {body.embed_dtype!r}", "embed_dtype")
    if body.endianness not in ENDIANNESS:
        raise invalid(f"endianness must be one of {', '.join(ENDIANNESS)}, not {body.endianness!r}", "endianness")
    if body.dimensions is not None:
        raise invalid("this model does not support Matryoshka representations: dimensions cannot "
                      "change its embeddings' size", "dimensions")


def _is_chat(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in x)


def chats(body: EmbeddingRequest) -> list[list[Any]] | None:
    """The chats to embed, if the call gives chats (in `messages`, or in `input`)."""
    x = body.messages if body.messages is not None else body.input
    found = [x] if _is_chat(x) else x if isinstance(x, list) and x and all(map(_is_chat, x)) else None
    if found is None and body.messages is not None:
        raise invalid("messages must be a chat (a list of messages with roles) or a list of chats", "messages")
    if found is not None and len(found) > MAX_INPUTS:
        raise invalid(f"messages holds {len(found)} chats; at most {MAX_INPUTS} per request", "messages")
    return found


def inputs(px: Proxy, body: EmbeddingRequest) -> tuple[list[str | list[int]], bool]:
    """The call's prompts, texts or token id lists, and whether they are chats."""
    if (body.input is None) == (body.messages is None):
        raise invalid("give either input or messages", "input")
    given = chats(body)
    if given is not None:
        return [_render(px, body, c) for c in given], True
    x = [body.input] if isinstance(body.input, str) else body.input
    if not x:
        raise invalid("input must not be empty", "input")
    if all(type(i) is int for i in x):
        return [x], False  # one prompt of token ids
    if len(x) > MAX_INPUTS:
        raise invalid(f"input holds {len(x)} inputs; at most {MAX_INPUTS} per request", "input")
    if all(isinstance(i, str) for i in x):
        if not all(x):
            raise invalid("input must not hold empty strings", "input")
        return x, False
    if all(isinstance(i, list) and all(type(t) is int for t in i) for i in x):
        if not all(x):
            raise invalid("input must not hold empty token lists", "input")
        return x, False
    raise invalid("input must be a string, a list of strings, a list of token ids, a list of token id "
                  "lists or chats, not a mix", "input")


def _render(px: Proxy, body: EmbeddingRequest, chat: list[Any]) -> str:
    """A chat as the model's chat template renders it."""
    try:
        msgs = msgspec.convert(chat, list[Message])
    except msgspec.ValidationError as exc:
        raise invalid(f"invalid chat message: {exc}", "messages", "invalid_type") from None
    template = schemas.template(body.chat_template_kwargs, body.add_generation_prompt, body.continue_final_message,
                                chat_template=schemas.own(body.chat_template, px.config.trust_chat_template))
    messages, render = px.chat_form([schemas.message(i, m) for i, m in enumerate(msgs)], None, template)
    return render(messages)


async def embed(px: Proxy, body: EmbeddingRequest, headers: Mapping[str, str],
                prefix: str = "embd") -> EmbeddingList | Binary:
    """Every input embedded, in their order, encoded as the call asks."""
    check(body)
    prompts, chat = inputs(px, body)
    special = body.add_special_tokens if body.add_special_tokens is not None else not chat
    key, how = shape(px, body, headers, special)
    got = await pool(px, f"{prefix}-{key}", prompts, how, "messages" if chat else "input")
    used = sum(got.tokens)
    id, created, model = f"{prefix}-{key}", int(time.time()), px.names[0]
    if body.encoding_format in ("bytes", "bytes_only"):
        packed = [packed_vector(v, body.embed_dtype, body.endianness) for v in got.vectors]
        meta = None
        if body.encoding_format == "bytes":
            ends = list(accumulate(map(len, packed)))
            items = [{"index": i, "embed_dtype": body.embed_dtype, "endianness": body.endianness,
                      "start": end - len(b), "end": end, "shape": [len(v)]}
                     for i, (b, end, v) in enumerate(zip(packed, ends, got.vectors))]
            meta = json.dumps({"id": id, "created": created, "model": model, "data": items,
                               "usage": {"prompt_tokens": used, "total_tokens": used}})
        return Binary(b"".join(packed), meta, id)
    data = [Embedding(i, v if body.encoding_format == "float"
                      else b64encode(packed_vector(v, body.embed_dtype, body.endianness)).decode())
            for i, v in enumerate(got.vectors)]
    return EmbeddingList(id, created, model, data, EmbeddingUsage(used, used))


async def pooling(px: Proxy, body: PoolingRequest, headers: Mapping[str, str]) -> PoolingList | Binary:
    """vLLM's `/pooling` for an embedding model: the embeddings, as pooling outputs."""
    if body.task not in (None, "embed"):
        raise invalid(f"task {body.task!r} is not served: this model pools embeddings only (embed)", "task")
    out = await embed(px, body, headers, "pool")
    if isinstance(out, Binary):
        return out
    return PoolingList(out.id, out.created, out.model, [PoolingData(d.index, d.embedding) for d in out.data],
                       out.usage)


def packed_vector(v: list[float], dtype: str, endianness: str) -> bytes:
    """A vector's bytes in `dtype` (vLLM's embed_dtype) and byte order."""
    order = sys.byteorder if endianness == "native" else endianness
    if dtype == "float32":  # the openai SDK's base64: no torch needed for it
        return struct.pack(f"{'<' if order == 'little' else '>'}{len(v)}f", *v)
    import torch  # the other dtypes round as torch rounds them (vLLM's conversion)

    kinds = {"float16": torch.float16, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
             "fp8_e5m2": torch.float8_e5m2}
    raw = torch.tensor(v, dtype=torch.float32).to(kinds[dtype]).view(torch.uint8).numpy()
    if order != sys.byteorder and raw.size > len(v):  # two-byte values: swap each pair
        raw = raw.reshape(-1, 2)[:, ::-1]
    return raw.tobytes()
