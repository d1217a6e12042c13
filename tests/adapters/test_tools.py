"""A LangChain agent's tool loop through the proxy on the tiny engine: bind_tools with a
forced choice gives a parsed call, the tool's result goes back as LangChain writes it
(arguments as JSON text, a tool message with its call's id), and that second request
stays in the agent's round without waiting at the barrier."""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Literal

import pytest

pytest.importorskip("langchain_openai")

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

from tokendance.adapters.langgraph import chat_model  # noqa: E402
from tokendance.adapters.rounds import Rounds  # noqa: E402
from tokendance.backend.service import EngineBackend  # noqa: E402
from tokendance.examples.local import threaded  # noqa: E402


@tool
def get_weather(city: Literal["Paris", "Rome", "Oslo"], unit: Literal["C", "F"]) -> str:
    """The weather of a city."""
    return f"18 {unit} and sunny in {city}"


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_a_langchain_tool_loop_stays_in_its_agents_round(tiny_llama, responses):
    """Also through OpenAI's Responses API: the call a function_call item, its result a
    function_call_output."""
    be = EngineBackend.load(str(tiny_llama), dtype="float32", mode="collective")
    with threaded(be, barrier_timeout=10.0) as url:
        session = "tool-loop"
        ctl = Rounds(session, url)
        ctl.announce(1, ["ada", "bo"])
        kw = dict(url=url, temperature=0.0, max_retries=0, use_responses_api=responses)
        llm = chat_model(session, agent="ada", max_tokens=40, **kw)
        other = chat_model(session, agent="bo", max_tokens=8, **kw)
        with_tools = llm.bind_tools([get_weather], tool_choice="get_weather")
        first = [HumanMessage("What is the weather in Oslo?")]
        with cf.ThreadPoolExecutor(2) as pool:  # both agents of round 1 at once: one group
            asked = pool.submit(with_tools.invoke, first)
            pool.submit(other.invoke, [HumanMessage("Say hello.")]).result(60)
            ai = asked.result(60)
        assert isinstance(ai, AIMessage) and len(ai.tool_calls) == 1, ai
        call = ai.tool_calls[0]
        assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome", "Oslo")
        result = get_weather.invoke(call)
        assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
        t0 = time.perf_counter()
        final = llm.bind_tools([get_weather]).invoke(first + [ai, result])
        assert time.perf_counter() - t0 < 5  # not held for the 10 s barrier
        ended = final.response_metadata.get("status" if responses else "finish_reason")
        assert isinstance(final, AIMessage) and ended in ("stop", "length", "tool_calls", "completed", "incomplete")
        stats = ctl.stats(1)
        assert stats["requests"] == 3 and stats["group_sizes"] == [2] and stats["errors"] == 0, stats
