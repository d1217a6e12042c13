"""OpenAI's deprecated function calling through the proxy with the openai SDK: the call
comes back as `message.function_call` (whole) or `delta.function_call` (streamed), one
call an answer, finish_reason `function_call`; a forced function is held to its schema
on the real engine; an old conversation (an assistant's function_call, the function's
result) reaches the template as tool calls and tool results."""

from __future__ import annotations

import json

from tests.proxy.test_tools import ASK, TIME, WEATHER, user, weather_ok

FUNCTIONS = [WEATHER["function"], TIME["function"]]
TWO = ASK + ' <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'


def old_stream(chunks) -> tuple[str, str | None, str, str | None]:
    """A stream's content, its call's name and arguments and its finish reason, put
    together as old clients did."""
    content, name, args, finish = "", None, "", None
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        assert not ch.delta.tool_calls
        content += ch.delta.content or ""
        if ch.delta.function_call is not None:
            name = name or ch.delta.function_call.name
            args += ch.delta.function_call.arguments or ""
        finish = ch.finish_reason or finish
    return content, name, args, finish


def test_a_call_comes_back_as_function_call_whole_and_streamed(client):
    kw = dict(model="fake-tiny", messages=user(ASK), functions=FUNCTIONS)
    ch = client.chat.completions.create(**kw).choices[0]
    assert (ch.finish_reason, ch.message.content, ch.message.tool_calls) == ("function_call", "Sure.", None)
    assert ch.message.function_call.name == "get_weather"
    assert json.loads(ch.message.function_call.arguments) == {"city": "Paris", "unit": "C"}
    content, name, args, finish = old_stream(client.chat.completions.create(**kw, stream=True))
    assert (content, name, finish) == ("Sure.", "get_weather", "function_call")
    assert json.loads(args) == {"city": "Paris", "unit": "C"}


def test_one_call_an_answer_and_none_reads_none(client):
    ch = client.chat.completions.create(model="fake-tiny", messages=user(TWO), functions=FUNCTIONS).choices[0]
    assert ch.message.function_call.name == "get_weather" and ch.message.tool_calls is None
    none = client.chat.completions.create(model="fake-tiny", messages=user(ASK), functions=FUNCTIONS,
                                        function_call="none").choices[0]
    assert (none.message.content, none.message.function_call, none.finish_reason) == (ASK, None, "stop")


def test_an_old_conversation_reaches_the_template_as_tool_calls_and_results(client, echo):
    convo = [*user("Weather in Paris?"),
             {"role": "assistant", "content": None,
              "function_call": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}},
             {"role": "function", "name": "get_weather", "content": "18 and sunny"}]
    old = client.chat.completions.create(model="fake-tiny", messages=convo, functions=FUNCTIONS)
    prompt = echo.backend.last_prompt()
    new = [*convo[:1],
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1_0", "type": "function", "function": convo[1]["function_call"]}]},
           {"role": "tool", "tool_call_id": "call_1_0", "content": "18 and sunny"}]
    client.chat.completions.create(model="fake-tiny", messages=new, tools=[WEATHER, TIME])
    assert prompt == echo.backend.last_prompt() and "<tool_response>\n18 and sunny\n</tool_response>" in prompt
    assert old.choices[0].message.function_call is None and old.choices[0].finish_reason == "stop"


def test_a_forced_function_is_held_to_its_schema(engine_client, engine_model):
    kw = dict(model=engine_model, messages=user("Weather?"), functions=FUNCTIONS, max_tokens=60, temperature=0,
              function_call={"name": "get_weather"})
    ch = engine_client.chat.completions.create(**kw).choices[0]
    assert (ch.finish_reason, ch.message.content, ch.message.tool_calls) == ("stop", None, None)
    assert ch.message.function_call.name == "get_weather" and weather_ok(ch.message.function_call.arguments)
    content, name, args, finish = old_stream(engine_client.chat.completions.create(**kw, stream=True))
    assert (content, name, args, finish) == ("", "get_weather", ch.message.function_call.arguments, "stop")
