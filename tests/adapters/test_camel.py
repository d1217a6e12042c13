"""CAMEL: a 3-agent, 2-round All-Gather of ChatAgents stepping together."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("camel")

from camel.agents import ChatAgent  # noqa: E402

from tokendance.adapters.camel import ApproxCounter, model, set_round  # noqa: E402
from tokendance.adapters.rounds import Rounds  # noqa: E402
from tokendance.adapters.tags import PREFIX  # noqa: E402

from .conftest import AGENTS  # noqa: E402

QUESTION = "Which planet is closest to the sun?"


async def test_all_gather(proxy_url: str, check_rounds) -> None:
    session = "camel-1"
    ctl = Rounds(session, proxy_url)
    models = {a: model(session, a, url=proxy_url, round=1, config={"max_tokens": 16, "temperature": 0.0})
              for a in AGENTS}
    bots = {a: ChatAgent(f"You are {a}.", model=m) for a, m in models.items()}
    task = {a: QUESTION for a in AGENTS}
    for r in (1, 2):
        for m in models.values():
            set_round(m, r)
        await ctl.aannounce(r, AGENTS)
        steps = await asyncio.gather(*(bots[a].astep(task[a]) for a in AGENTS))
        said = {a: s.msgs[0].content for a, s in zip(AGENTS, steps)}
        task = {a: "Others answered:\n\n" + "\n\n".join(
            f"{b} answered:\n{said[b]}" for b in AGENTS if b != a) + "\n\nRevise your answer."
            for a in AGENTS}
    check_rounds(session, 2)


def test_tags_and_counter(proxy_url: str) -> None:
    m = model("camel-2", "Ada", url=proxy_url, round=3)
    assert str(m.model_type) == "echo"
    assert m.model_config_dict["extra_headers"] == {PREFIX + "Round": "3"}
    set_round(m, 4)
    assert m.model_config_dict["extra_headers"] == {PREFIX + "Round": "4"}
    c = ApproxCounter()
    assert c.decode(c.encode("héllo")) == "héllo"
    assert c.count_tokens_from_messages([{"role": "user", "content": "x" * 40}]) == 14
