"""CAMEL: a model backend from ModelFactory (OPENAI_COMPATIBLE_MODEL) at the proxy.

One backend per agent: session and agent go in the OpenAI client's default headers,
the round in `model_config_dict["extra_headers"]`, which CAMEL copies into every
request, so `set_round` moves an agent to the next round without rebuilding it:

    m = model("society-1", "alice")
    bot = ChatAgent("You are Alice.", model=m)
    set_round(m, 2); bot.step("...")
"""

from __future__ import annotations

from typing import Any

from camel.models import BaseModelBackend, ModelFactory
from camel.types import ModelPlatformType
from camel.utils import BaseTokenCounter

from tokendance.adapters.rounds import served_model
from tokendance.adapters.tags import PREFIX, api_base, headers


class ApproxCounter(BaseTokenCounter):
    """Counts ~4 bytes a token, offline (CAMEL's default counter fetches tiktoken
    files from the network). Encodes to UTF-8 bytes, so encode/decode round-trip."""

    def count_tokens_from_messages(self, messages: list[dict[str, Any]]) -> int:
        text = sum(len(str(m.get("content") or "").encode()) for m in messages)
        return (text + 3) // 4 + 4 * len(messages)

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode(errors="ignore")


def model(
    session: str,
    agent: str,
    *,
    url: str | None = None,
    model: str | None = None,
    round: int | None = None,
    mode: str | None = None,
    api_key: str = "tokendance",
    config: dict[str, Any] | None = None,
    **kw: Any,
) -> BaseModelBackend:
    """A CAMEL backend for `agent` of `session` on the proxy at `url`."""
    cfg = dict(config or {})
    cfg["extra_headers"] = {**cfg.get("extra_headers", {}), **headers(round=round, mode=mode)}
    kw.setdefault("token_counter", ApproxCounter())
    return ModelFactory.create(
        model_platform=ModelPlatformType.OPENAI_COMPATIBLE_MODEL,
        model_type=model or served_model(url, api_key),
        url=api_base(url),
        api_key=api_key,
        model_config_dict=cfg,
        default_headers=headers(session, agent),
        **kw,
    )


def set_round(backend: BaseModelBackend, round: int) -> None:
    """Tag the next requests of `backend` with `round`."""
    backend.model_config_dict.setdefault("extra_headers", {})[PREFIX + "Round"] = str(round)
