"""The plain OpenAI SDK: tags in default headers, shared blocks marked explicitly."""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai")

from tokendance.adapters.rounds import Rounds  # noqa: E402
from tokendance.adapters.tags import body, headers, shared  # noqa: E402

from .conftest import AGENTS  # noqa: E402

NOTES = ["The meeting moved to Thursday at noon.", "Bring the quarterly numbers, printed."]


async def test_explicit_shared_blocks(proxy_url: str, check_rounds) -> None:
    session = "oa-1"
    agents = {a: openai.AsyncOpenAI(base_url=proxy_url, api_key="k", default_headers=headers(
        session, a, separators=True)) for a in AGENTS}
    for r in (1, 2):
        await Rounds(session, proxy_url).aannounce(r, AGENTS)
        replies = await asyncio.gather(*(c.chat.completions.create(
            model="echo", max_tokens=12, messages=[
                {"role": "system", "content": f"You are {a}."},
                {"role": "user", "content": f"Notes:\n{shared(*NOTES)}\nWhat should {a} do?"}])
            for a, c in agents.items()))
        assert all(x.choices[0].message.content for x in replies)
    for c in agents.values():
        await c.close()
    first = (await Rounds(session, proxy_url).astats(1))
    assert first["shared_tokens"] > 0 and first["reused_tokens"] > 0  # marked, not found
    check_rounds(session, 2)


def test_tags() -> None:
    assert headers("s", separators=True) == {"X-TokenDance-Session": "s", "X-TokenDance-Separators": "true"}
    assert body(agent="a", round=2) == {"tokendance": {"agent": "a", "round": 2}}
    assert headers("s", agents=["a", "b"])["X-TokenDance-Agents"] == "a,b"  # a batch of chats' agents
    assert body(agents=["a", "b"]) == {"tokendance": {"agents": ["a", "b"]}}
    assert shared("a<|td-sep|>b") == "<|td-sep|>a<|td~-sep|>b<|td-sep|>"
