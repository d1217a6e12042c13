"""AutoGen: a 3-agent, 2-round All-Gather of AssistantAgents speaking in parallel."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("autogen_agentchat")
pytest.importorskip("autogen_ext.models.openai")

from autogen_agentchat.agents import AssistantAgent  # noqa: E402
from autogen_core.models import UserMessage  # noqa: E402

from tokendance.adapters.autogen import client, round_args  # noqa: E402
from tokendance.adapters.rounds import Rounds  # noqa: E402

from .conftest import AGENTS  # noqa: E402

QUESTION = "Name one prime number between 10 and 20."


async def test_all_gather(proxy_url: str, check_rounds) -> None:
    session = "ag-1"
    ctl = Rounds(session, proxy_url)
    clients = [client(session, a, url=proxy_url, max_tokens=16, temperature=0.0) for a in AGENTS]
    team = [AssistantAgent(a, model_client=c, system_message=f"You are {a}.")
            for a, c in zip(AGENTS, clients)]
    task = {a: QUESTION for a in AGENTS}
    for r in (1, 2):
        await ctl.aannounce(r, AGENTS)  # the round itself is counted by the proxy
        runs = await asyncio.gather(*(agent.run(task=task[agent.name]) for agent in team))
        said = {agent.name: run.messages[-1].content for agent, run in zip(team, runs)}
        task = {a: "Others answered:\n\n" + "\n\n".join(
            f"{b} answered:\n{said[b]}" for b in AGENTS if b != a) + "\n\nRevise your answer."
            for a in AGENTS}
    for c in clients:
        await c.close()
    check_rounds(session, 2)


async def test_explicit_round(proxy_url: str) -> None:
    c = client("ag-2", "Ada", url=proxy_url, max_tokens=8)
    Rounds("ag-2", proxy_url).announce(5, ["Ada"])
    out = await c.create([UserMessage(content="hi", source="user")], extra_create_args=round_args(5))
    await c.close()
    assert out.content
    assert Rounds("ag-2", proxy_url).stats(5)["agents"] == ["Ada"]
