"""Scenarios build All-Gather prompts: every agent's prompt quotes every round output."""

from __future__ import annotations

import pytest

from tokendance.examples.debate import Debate
from tokendance.examples.scenario import agents
from tokendance.examples.society import KEYWORD, Society
from tokendance.examples.town import Town


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
