"""Scenarios build All-Gather prompts: every agent's prompt quotes every round output."""

from __future__ import annotations

import asyncio

import pytest

from tokendance.adapters.rounds import ProxyError
from tokendance.examples.debate import Debate
from tokendance.examples.scenario import agents
from tokendance.examples.society import KEYWORD, Society
from tokendance.examples.town import WORTH, Memory, Town, ranked


def _play(s, rounds: int = 2) -> dict[str, list]:
    last: dict[str, list] = {}
    for r in range(1, rounds + 1):
        last = {a: s.messages(a, r) for a in s.agents}
        s.observe(r, {a: f"{a} speaks in round {r} of the {KEYWORD}." for a in s.agents})
    return last


def test_agent_names_are_unique() -> None:
    names = agents(45)
    assert len(set(names)) == 45 and names[:2] == ["Ada", "Bo"] and names[20] == "Ada2"
    with pytest.raises(ValueError):
        agents(0)


@pytest.mark.parametrize("kind", [Debate, Town])
def test_all_gather_prompts_quote_every_output(kind) -> None:
    s = kind(n=4, seed=3)
    s.messages("Ada", 1)
    s.observe(1, {a: f"{a} said something {i}" for i, a in enumerate(s.agents)})
    for a in s.agents:
        text = "".join(m["content"] for m in s.messages(a, 2))
        for i, b in enumerate(s.agents):
            assert f"{b} said something {i}" in text


def test_debate_offsets_differ() -> None:
    s = Debate(n=3, seed=0)
    s.observe(1, {a: f"answer of {a}" for a in s.agents})
    at = {a: s.messages(a, 2)[-1]["content"].index("answer of Ada") for a in ("Bo", "Cy")}
    assert at["Bo"] != at["Cy"]  # each agent sees the others in its own order


def test_seed_decides_everything() -> None:
    for kind in (Debate, Town, Society):
        a, b = _play(kind(n=5, seed=7)), _play(kind(n=5, seed=7))
        assert a == b


def test_society_spreads_news() -> None:
    s = Society(n=10, seed=1)
    assert 1 <= len(s.heard) < 10
    _play(s, 1)
    assert len(s.heard) == 10 and "10/10" in s.summary()


def test_recall_ranks_memories_by_recency_and_relevance() -> None:
    ms = [Memory("bread", 1, [0.0, 1.0]), Memory("rain", 2, [1.0, 0.0]), Memory("bees", 3, [0.0, 1.0]),
          Memory("dog", 4, [0.6, 0.8]), Memory("fountain", 5, [-1.0, 0.0])]
    # scores (recency + relevance, each scaled to [0, 1]): bread 0.50, rain 1.21, bees 0.95, dog 1.51,
    # fountain 1.00: the newest memory is not recalled, an old relevant one is
    assert [m.text for m in ranked(ms, [1.0, 0.0], now=6, keep=2)] == ["rain", "dog"]
    assert [m.text for m in ranked(ms, None, now=6, keep=2)] == ["dog", "fountain"]  # no query: the latest
    assert ranked(ms[:2], [1.0, 0.0], now=6, keep=3) == ms[:2]
    # importance adds a term (scaled: bread 1.0, rain 0.0, bees 0.9, dog 0.5, fountain 0.1): bread 1.50,
    # rain 1.21, bees 1.85, dog 2.01, fountain 1.10: bees now outranks rain
    for m, worth in zip(ms, (1.0, 0.0, 0.9, 0.5, 0.1)):
        m.importance = worth
    assert [m.text for m in ranked(ms, [1.0, 0.0], now=6, keep=2)] == ["bees", "dog"]
    # without embeddings recency and importance still rank: bread 1.00, rain 0.21, bees 1.35, dog 1.21,
    # fountain 1.10
    assert [m.text for m in ranked(ms, None, now=6, keep=2)] == ["bees", "dog"]


class Embedder:
    """A client whose server embeds a text as (its length, its count of 'r'), and judges
    a memory worth keeping in proportion to its count of 'a'."""

    def __init__(self, refuse: bool = False, judges: bool = True):
        self.calls: list[list[str]] = []
        self.judged: list[list[str]] = []
        self.refuse, self.judges = refuse, judges

    async def embed(self, texts: list[str]) -> list[list[float]]:
        self.calls.append(texts)
        if self.refuse:
            raise ProxyError(400, "the echo backend has no model to compute embeddings with")
        return [[float(len(t)), float(t.count("r"))] for t in texts]

    async def judge(self, items: list[str], question: str) -> list[float]:
        assert question == WORTH
        self.judged.append(items)
        if self.refuse or not self.judges:
            raise ProxyError(404, "Not Found")
        return [min(t.count("a") / 10, 1.0) for t in items]


def test_the_town_embeds_each_new_text_once_and_recalls_by_it() -> None:
    town, client = Town(n=3, seed=1), Embedder()
    for r in range(1, 5):
        asyncio.run(town.recall(client, r))
        prompts = {a: town.messages(a, r) for a in town.agents}
        town.observe(r, {a: f"{a} acts in round {r}" for a in town.agents})
    assert len(client.calls) == 4 and client.calls[0] == ["The town wakes up."]
    # after round 1: the new event, the round's event once (every agent saw it) and 3 actions
    assert len(client.calls[1]) == len(set(client.calls[1])) == 5
    recalled = prompts["Ada"][1]["content"].split("Town feed")[0]
    want = ranked(town.memory["Ada"][:6], town.query, 4)
    assert [line[2:] for line in recalled.splitlines()[1:4]] == [m.text for m in want]
    assert all(m.vector is not None for m in town.memory["Ada"][:6]) and "relevance" in town.summary()
    # each memory judged once, in one call a round (round 1 had none yet)
    assert len(client.judged) == 3 and all(len(j) == len(set(j)) for j in client.judged)
    assert all(m.importance is not None for m in town.memory["Ada"][:6])
    assert "relevance, importance and recency" in town.summary()


def _three_rounds(client: Embedder) -> Town:
    town = Town(n=2)
    for r in range(1, 4):
        asyncio.run(town.recall(client, r))
        town.observe(r, {a: f"{a} acts" for a in town.agents})
    return town


def test_a_server_that_judges_nothing_leaves_recall_to_relevance_and_recency() -> None:
    client = Embedder(judges=False)
    town = _three_rounds(client)
    assert len(client.judged) == 1 and not town.judges and town.embeds
    assert "by relevance and recency" in town.summary()


def test_a_server_that_embeds_nothing_leaves_recall_to_recency() -> None:
    client = Embedder(refuse=True)
    town = _three_rounds(client)
    assert len(client.calls) == 1 and not town.embeds and "recency" in town.summary()
    assert "- Round 3, I did: Ada acts" in town.messages("Ada", 4)[1]["content"]
    with pytest.raises(ProxyError):
        asyncio.run(Town().recall(type("Down", (Embedder,), {"embed": _down})(), 1))


async def _down(self, texts: list[str]) -> list[list[float]]:
    raise ProxyError(503, "the engine is down")
