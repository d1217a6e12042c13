"""Two OpenAI Agents SDK agents through the proxy: run by tests/adapters/test_agents_sdk.py
in a venv of their own (`openai-agents` pins a pydantic that `camel-ai` refuses, so the
two cannot share the test venv; .ci/setup makes .venv-agents). Prints what the test
checks as one JSON line.

    python agents_sdk_run.py BASE_URL MODEL responses|chat
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Literal

from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                    function_tool, set_tracing_disabled)
from openai import AsyncOpenAI

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>'


@function_tool
def get_weather(city: Literal["Paris", "Rome", "Oslo"], unit: Literal["C", "F"]) -> str:
    """The weather of a city."""
    return f"18 {unit} and sunny in {city}"


def connect(url: str, api: str, name: str) -> AsyncOpenAI:
    """A client whose requests name the session and the agent (tokendance.adapters.tags.headers)."""
    return AsyncOpenAI(base_url=url, api_key="sk-agents", max_retries=0, default_headers={
        "X-TokenDance-Session": f"agents-{api}", "X-TokenDance-Agent": name})


def agent(url: str, model: str, api: str, name: str) -> Agent:
    client = connect(url, api, name)
    m = OpenAIResponsesModel(model, client) if api == "responses" else OpenAIChatCompletionsModel(model, client)
    return Agent(name=name, instructions=f"You are {name}. Be brief.", model=m, tools=[get_weather],
                 model_settings=ModelSettings(temperature=0, max_tokens=64))


async def main(url: str, model: str, api: str) -> dict:
    set_tracing_disabled(True)
    ada, bo = agent(url, model, api, "ada"), agent(url, model, api, "bo")
    # Round 1: ada calls a tool (the echo model repeats the call it is shown), bo streams.
    streamed = Runner.run_streamed(bo, "Say hello to everyone in the room today.")
    kinds: list[str] = []

    async def watch() -> None:
        async for e in streamed.stream_events():
            kinds.append(e.data.type if e.type == "raw_response_event" else e.type)

    first, _ = await asyncio.gather(Runner.run(ada, f"What is the weather in Oslo? {CALL}"), watch())
    calls = [i.raw_item for i in first.new_items if i.type == "tool_call_item"]
    outputs = [i.output for i in first.new_items if i.type == "tool_call_output_item"]
    said = {"ada": first.final_output, "bo": streamed.final_output}
    # Round 2: each agent reads the other's answer (the proxy finds it as a shared segment);
    # through the Responses API ada's conversation goes on from the proxy's stored response,
    # bo's in a conversation object the proxy keeps.
    chained, kept, conv = {}, {}, None
    if api == "responses":
        conversations = connect(url, api, "bo").conversations
        conv = await conversations.create(items=[{"role": "user", "content": "Hello, bo."}])
        chained, kept = {"previous_response_id": first.last_response_id}, {"conversation_id": conv.id}
    second = await asyncio.gather(
        Runner.run(ada, f"bo said: {said['bo']}\nWhat do you say?", **chained),
        Runner.run(bo, f"ada said: {said['ada']}\nWhat do you say?", **kept))
    items = [] if conv is None else (await conversations.items.list(conv.id, order="asc")).data
    return {"calls": [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls],
            "outputs": outputs, "said": said, "kinds": kinds,
            "second": [r.final_output for r in second],
            "usage": [r.context_wrapper.usage.input_tokens for r in second],
            "conversation": [i.content[0].text for i in items]}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:4]))))
