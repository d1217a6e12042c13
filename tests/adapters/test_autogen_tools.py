"""AutoGen: an AssistantAgent with a tool through the proxy. The fake backend echoes a
Hermes call the task asks for; AutoGen runs the tool and reflects on its result, and
that second request resumes the agent's turn in its round."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("autogen_agentchat")
pytest.importorskip("autogen_ext.models.openai")

from autogen_agentchat.agents import AssistantAgent  # noqa: E402
from autogen_agentchat.messages import ToolCallExecutionEvent, ToolCallRequestEvent  # noqa: E402

from tokendance.adapters.autogen import client  # noqa: E402
from tokendance.adapters.rounds import Rounds  # noqa: E402
from tokendance.examples.local import threaded  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "adapters_fake_backend", Path(__file__).parents[1] / "proxy" / "fake_backend.py")
fake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake)

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


async def get_weather(city: str) -> str:
    """The weather of a city."""
    return f"cold in {city}"


async def test_an_assistant_agent_calls_a_tool_and_reflects_in_its_round() -> None:
    backend = fake.FakeBackend(length=40)
    with threaded(backend, barrier_timeout=10.0) as url:
        session = "ag-tools"
        ctl = Rounds(session, url)
        await ctl.aannounce(1, ["ada"])
        c = client(session, "ada", url=url, model="fake-tiny", max_tokens=40)
        agent = AssistantAgent("ada", model_client=c, tools=[get_weather], reflect_on_tool_use=True)
        run = await agent.run(task=f"Please {CALL}")
        await c.close()
        (asked,) = [m for m in run.messages if isinstance(m, ToolCallRequestEvent)]
        assert [(f.name, f.arguments) for f in asked.content] == [("get_weather", '{"city": "Oslo"}')]
        (done,) = [m for m in run.messages if isinstance(m, ToolCallExecutionEvent)]
        assert done.content[0].content == "cold in Oslo"
        assert "cold in Oslo" in run.messages[-1].content  # the reflection read the result
        stats = await ctl.astats(1)
        assert stats["requests"] == 2 and stats["group_sizes"] == [1], stats
        assert backend.groups[-1][0].round == 1
