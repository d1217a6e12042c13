"""LangGraph / LangChain: a ChatOpenAI pointed at the proxy.

One model can serve every agent of a graph: session (and mode) ride in its
`default_headers`, agent and round in per-call `extra_headers`:

    llm = chat_model("debate-1")
    def speak(state):                      # a node, reached through Send(...)
        return llm.invoke(msgs, **tag(state["agent"], state["round"]))

or bind them once per agent: `tag_model(llm, "alice", 2).invoke(msgs)`. Agents' memories
can embed with the same server and model: `embeddings()` (an OpenAIEmbeddings). Agents
written for Claude use `chat_model(..., anthropic=True)` (a ChatAnthropic on the proxy's
Messages API, the extra `[anthropic]`), tagged the same way.
"""

from __future__ import annotations

from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.runnables import Runnable
from langchain_openai import ChatOpenAI, OpenAIEmbeddings

from tokendance.adapters.rounds import served_model
from tokendance.adapters.tags import api_base, headers


def chat_model(
    session: str,
    *,
    agent: str | None = None,
    url: str | None = None,
    model: str | None = None,
    mode: str | None = None,
    api_key: str = "tokendance",
    anthropic: bool = False,
    **kw: Any,
) -> BaseChatModel:
    """ChatOpenAI for the proxy at `url`, tagged with `session` (and `agent`, `mode`);
    with `anthropic`, a ChatAnthropic on its Messages API (the extra `[anthropic]`)."""
    common = dict(model=model or served_model(url, api_key), api_key=api_key,
                  default_headers=headers(session, agent, mode=mode), **kw)
    if anthropic:
        from langchain_anthropic import ChatAnthropic

        return ChatAnthropic(base_url=api_base(url).removesuffix("/v1"), **common)
    return ChatOpenAI(base_url=api_base(url), **common)


def tag(agent: str, round: int | None = None, mode: str | None = None) -> dict[str, Any]:
    """Per-call keyword arguments: `llm.invoke(msgs, **tag("alice", 1))`."""
    return {"extra_headers": headers(agent=agent, round=round, mode=mode)}


def tag_model(llm: BaseChatModel, agent: str, round: int | None = None) -> Runnable:
    """`llm` bound to one agent (and round)."""
    return llm.bind(**tag(agent, round))


def embeddings(*, url: str | None = None, model: str | None = None, api_key: str = "tokendance",
               **kw: Any) -> OpenAIEmbeddings:
    """OpenAIEmbeddings for the proxy at `url` (its /v1/embeddings). Texts go as they are:
    LangChain's length check would first split them with OpenAI's tokenizer, not the
    served model's."""
    return OpenAIEmbeddings(model=model or served_model(url, api_key), base_url=api_base(url), api_key=api_key,
                            check_embedding_ctx_length=False, **kw)
