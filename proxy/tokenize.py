"""vLLM's `/tokenize` and `/detokenize`: a prompt's token ids as a completion or chat
request of the same text would get them, and the text of token ids."""

from __future__ import annotations

from typing import Any

from msgspec import Struct

from tokendance.backend.api import Segment

from . import schemas
from . import tools as t
from .core import Proxy
from .errors import ApiError, invalid
from .schemas import Message, message


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None  # a completion's text prompt, or
    messages: list[Message] | None = None  # a chat's, rendered by its template
    tools: list[t.Tool] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: where the server trusts them (schemas.own)
    return_token_strs: bool = False


class Tokenized(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class Detokenized(Struct):
    prompt: str


def tokenize(px: Proxy, body: TokenizeRequest) -> Tokenized:
    from tokendance.backend.prompt import tokenize as tokenize_segments  # with grammar and torch: not at import

    tok = _tokenizer(px, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise invalid("give either prompt or messages", "prompt")
    if body.prompt is not None:
        text, special = body.prompt, body.add_special_tokens is not False
    else:
        if not body.messages:
            raise invalid("messages must not be empty", "messages")
        template = schemas.template(body.chat_template_kwargs, body.add_generation_prompt, body.continue_final_message,
                                    chat_template=schemas.own(body.chat_template, px.config.trust_chat_template))
        tools = t.check(body.tools, None, None)
        if tools is not None:
            tools.dialect = px.dialect(template)
        messages, render = px.chat_form([message(i, m) for i, m in enumerate(body.messages)], tools, template)
        text, special = render(messages), bool(body.add_special_tokens)
    ids = tokenize_segments(tok, [Segment(text)], special)[0]
    strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return Tokenized(len(ids), px.backend.info.max_model_len, ids, strs)


def detokenize(px: Proxy, body: DetokenizeRequest) -> Detokenized:
    tok = _tokenizer(px, body.model)
    outside = [i for i in body.tokens if not 0 <= i < len(tok)]
    if outside:
        raise invalid(f"token ids outside the vocabulary [0, {len(tok)}): "
                      f"{', '.join(map(str, outside[:5]))}", "tokens")
    return Detokenized(tok.decode(body.tokens))


def _tokenizer(px: Proxy, model: str | None) -> Any:
    if model is not None:
        px.served(model)
    tok = px.backend.tokenizer
    if tok is None:
        raise ApiError(501, f"the {px.backend.info.name} backend has no tokenizer", code="unsupported")
    return tok
