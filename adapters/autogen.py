"""AutoGen (autogen-ext): an OpenAIChatCompletionClient per agent, pointed at the proxy.

AutoGen's client takes no per-call headers, so each agent gets its own client whose
`default_headers` carry session and agent. Rounds need no tag: the proxy counts an
agent's requests (its k-th request in a session is round k), and `Rounds.announce`
names who takes part. With `client.create(...)` directly, pass
`extra_create_args=round_args(r)` to name the round explicitly.

    team = [AssistantAgent(n, model_client=client("debate-1", n)) for n in names]
    await asyncio.gather(*(a.run(task=question) for a in team))   # one round
"""

from __future__ import annotations

from typing import Any

from autogen_core.models import ModelFamily, ModelInfo
from autogen_ext.models.openai import OpenAIChatCompletionClient

from tokendance.adapters.rounds import served_model
from tokendance.adapters.tags import api_base, body, headers

# What AutoGen must be told about a model it does not know by name: the proxy serves
# tools (docs/proxy.md, "Tool calling"), JSON mode and JSON schemas for any model.
INFO = ModelInfo(
    vision=False,
    function_calling=True,
    json_output=True,
    family=ModelFamily.UNKNOWN,
    structured_output=True,
    multiple_system_messages=True,
)


def client(
    session: str,
    agent: str,
    *,
    url: str | None = None,
    model: str | None = None,
    mode: str | None = None,
    api_key: str = "tokendance",
    model_info: ModelInfo | None = None,
    **kw: Any,
) -> OpenAIChatCompletionClient:
    """A chat completion client for `agent` of `session` on the proxy at `url`."""
    return OpenAIChatCompletionClient(
        model=model or served_model(url, api_key),
        base_url=api_base(url),
        api_key=api_key,
        model_info=model_info or INFO,
        default_headers=headers(session, agent, mode=mode),
        **kw,
    )


def round_args(round: int, mode: str | None = None) -> dict[str, Any]:
    """`extra_create_args` naming the round of one `create` call."""
    return {"extra_body": body(round=round, mode=mode)}
