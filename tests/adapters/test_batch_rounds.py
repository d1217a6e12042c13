"""`Rounds.chats`: a round of agents in one batch of chats, without announcing it; the
next round reuses its answers, and its stats name its agents."""

from __future__ import annotations

import asyncio

import pytest

from tokendance.adapters.rounds import ProxyError, Rounds

from .conftest import AGENTS

QUESTION = "How many legs do three spiders have in total?"


def test_two_rounds_each_in_one_request(proxy_url: str, check_rounds) -> None:
    ctl = Rounds("batched", proxy_url)
    first = ctl.chats(1, {a: [{"role": "user", "content": f"You are {a}. {QUESTION}"}] for a in AGENTS},
                      max_tokens=12)
    assert list(first) == AGENTS and all(first.values())
    quote = "\n\n".join(f"{a} answered:\n{t}" for a, t in first.items())
    second = asyncio.run(ctl.achats(2, {a: [{"role": "user", "content": f"You are {a}. {QUESTION}\n\n{quote}"}]
                                        for a in AGENTS}, max_tokens=12))
    assert list(second) == AGENTS
    stats = check_rounds("batched", 2)  # one group of all agents a round; round 2 reused round 1's answers
    assert stats[1]["requests"] == 1 and sorted(stats[1]["per_agent"]) == AGENTS


def test_a_bad_round_is_the_proxys_400(proxy_url: str) -> None:
    with pytest.raises(ProxyError) as e:
        Rounds("batched", proxy_url).chats(1, {"a": []})
    assert e.value.status == 400
    with pytest.raises(ValueError):
        Rounds("batched", proxy_url).chats(1, {})
