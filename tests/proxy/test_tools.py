"""Tool calling through the proxy with the openai SDK: `auto` calls read out of the text
(the fake backend echoes what it is asked to), `required` and named functions held to
the tools' schemas on the real engine, whole and streamed; the prompt a template without
tools gets; a tool's result resuming its agent's turn in the same round, at once."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from functools import partial
from typing import Literal

import openai
import pydantic
import pytest

from tokendance.backend.prompt import render_chat
from tokendance.proxy import tools

from .conftest import FakeBackend, Threaded

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                  "unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
ASK = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>'


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def weather_ok(arguments: str) -> bool:
    v = json.loads(arguments)
    return set(v) == {"city", "unit"} and v["city"] in ("Paris", "Rome", "Oslo") and v["unit"] in "CF"


def gathered(chunks) -> tuple[str, list[tuple[str, str, str]], str]:
    """A stream's content, its calls (id, name, arguments) and finish reason, put together
    by index as clients do."""
    content, calls, finish = "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or ():
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name, d
                calls[d.index] = [d.id, d.function.name, ""]
            calls[d.index][2] += d.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.fixture(scope="module")
def echo():
    t = Threaded(FakeBackend(length=40))
    yield t
    t.close()


@pytest.fixture(scope="module")
def fake(echo) -> openai.OpenAI:
    return echo.client()


def test_auto_reads_a_hermes_call_whole_and_streamed(fake):
    kw = dict(model="fake-tiny", messages=user(ASK), tools=[WEATHER, TIME])
    whole = fake.chat.completions.create(**kw)
    ch = whole.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Sure."
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}
    chunks = list(fake.chat.completions.create(**kw, stream=True))
    content, calls, finish = gathered(chunks)
    assert (content, finish) == ("Sure.", "tool_calls")
    assert [(n, a) for _, n, a in calls] == [("get_weather", call.function.arguments)]
    args = [d.function.arguments for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()
            if d.function.arguments]
    assert len(args) > 1  # the arguments stream as the model writes them


def test_without_a_call_auto_and_none_change_nothing(fake):
    text = "no call here <tool_call> only a tag"
    plain = fake.chat.completions.create(model="fake-tiny", messages=user(text))
    for choice in ("auto", "none"):
        got = fake.chat.completions.create(model="fake-tiny", messages=user(text), tools=[WEATHER],
                                           tool_choice=choice)
        assert got.choices[0].message.content == plain.choices[0].message.content == text
        assert got.choices[0].message.tool_calls is None and got.choices[0].finish_reason == "stop"
    called = fake.chat.completions.create(model="fake-tiny", messages=user(ASK), tools=[WEATHER],
                                          tool_choice="none")
    assert called.choices[0].message.content == ASK  # none: nothing is read as a call


def test_a_template_without_tools_gets_them_in_the_messages(fake, echo):
    convo = [*user("Weather in Paris?"),
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Paris", "unit": "C"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "18 and sunny"}]
    got = fake.chat.completions.create(model="fake-tiny", messages=convo, tools=[WEATHER])
    prompt = echo.backend.last_prompt()
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and '"name": "get_weather"' in prompt
    assert tools.call_text("get_weather", {"city": "Paris", "unit": "C"}) in prompt
    assert "<|im_start|>user\n<tool_response>\n18 and sunny\n</tool_response><|im_end|>" in prompt
    assert got.choices[0].message.content.endswith("18 and sunny </tool_response>")


def test_a_tools_result_resumes_its_agents_turn_in_the_same_round(echo, fake):
    """Agents Ada and Bo answer round 1 together; Ada calls a tool and sends its result:
    that request is still round 1 and starts at once (the barrier would hold it 10 s).
    Round 2 is then both agents' next request."""
    s = "tools-resume"
    t = partial(dict, model="fake-tiny", tools=[WEATHER])
    echo.server.proxy.barrier.timeout = 10.0
    try:
        hdr = lambda agent: {"X-TokenDance-Session": s, "X-TokenDance-Agent": agent}  # noqa: E731

        async def both(messages: dict) -> list:
            http = openai.AsyncOpenAI(base_url=echo.url + "/v1", api_key="sk-test", max_retries=0)
            return await asyncio.gather(*(http.chat.completions.with_raw_response.create(
                **t(messages=messages[a]), extra_headers=hdr(a)) for a in ("Ada", "Bo")))

        urllib.request.urlopen(urllib.request.Request(  # round 1's group leaves once both are there
            f"{echo.url}/v1/tokendance/sessions/{s}/rounds/1", data=json.dumps({"agents": ["Ada", "Bo"]}).encode(),
            headers={"Content-Type": "application/json"}))
        first = asyncio.run(both({"Ada": user(ASK), "Bo": user("Bo thinks about the weather today")}))
        assert [r.headers["X-TokenDance-Round"] for r in first] == ["1", "1"]
        assert [r.headers["X-TokenDance-Group"] for r in first] == ["2", "2"]
        call = first[0].parse().choices[0].message
        resumed = [*user(ASK), call.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "18 and sunny"}]
        t0 = time.perf_counter()
        back = fake.chat.completions.with_raw_response.create(**t(messages=resumed), extra_headers=hdr("Ada"))
        assert time.perf_counter() - t0 < 5
        assert (back.headers["X-TokenDance-Round"], back.headers["X-TokenDance-Group"]) == ("1", "1")
        second = asyncio.run(both({"Ada": user("Ada round two"), "Bo": user("Bo round two")}))
        assert [r.headers["X-TokenDance-Round"] for r in second] == ["2", "2"]
        assert [r.headers["X-TokenDance-Group"] for r in second] == ["2", "2"]
        stats = echo.server.proxy.sessions.find(s, 1).view()
        assert stats["requests"] == 3 and stats["group_sizes"] == [2]
        text = urllib.request.urlopen(echo.url + "/metrics").read().decode()
        assert re.search(r'^tokendance_groups_total\{reason="resume"\} 1(\.0)?$', text, re.M), text
    finally:
        echo.server.proxy.barrier.timeout = 0.25




def test_a_named_function_is_held_to_its_schema_whole_and_streamed(engine_client, engine_model):
    kw = dict(model=engine_model, messages=user("Weather?"), tools=[WEATHER, TIME], max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = engine_client.chat.completions.create(**kw)
    ch = whole.choices[0]
    assert ch.finish_reason == "stop" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and weather_ok(call.function.arguments), call
    content, calls, finish = gathered(engine_client.chat.completions.create(**kw, stream=True))
    assert (content, finish) == ("", "stop")
    assert [(n, a) for _, n, a in calls] == [("get_weather", call.function.arguments)]


@pytest.mark.parametrize("parallel", [None, False])
def test_required_gives_calls_of_the_given_tools(engine_client, engine_model, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    kw = dict(model=engine_model, messages=user("Weather and time?"), tools=[WEATHER, TIME], max_tokens=120,
              temperature=0, tool_choice="required", **extra)
    whole = engine_client.chat.completions.create(**kw)
    ch = whole.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    assert ch.message.tool_calls and (parallel is None or len(ch.message.tool_calls) == 1)
    for c in ch.message.tool_calls:
        zone = c.function.name == "get_time" and json.loads(c.function.arguments)["zone"] in ("UTC", "CET")
        assert zone or (c.function.name == "get_weather" and weather_ok(c.function.arguments)), c
    content, calls, finish = gathered(engine_client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and [(n, a) for _, n, a in calls] == [
        (c.function.name, c.function.arguments) for c in ch.message.tool_calls]


def test_auto_with_a_strict_tool_reaches_the_engine_as_a_structural_tag(engine_client, engine_model,
                                                                       engine_live, monkeypatch):
    """The grammar's own checks are in test_tags.py; here, that the engine compiles and
    applies it, and the answer that wrote no call is content as with free `auto`."""
    seen = []
    grammars = engine_live.backend.engine.grammars
    compile_ = grammars.compile
    monkeypatch.setattr(grammars, "compile", lambda st: seen.append(st.kind) or compile_(st))
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    got = engine_client.chat.completions.create(model=engine_model, messages=user("Weather?"), tools=[strict, TIME],
                                                max_tokens=12, temperature=0)
    c = got.choices[0]
    assert "structural_tag" in seen and c.finish_reason == "length" and c.message.content
    assert c.message.tool_calls is None


class Pick(pydantic.BaseModel):
    side: Literal["left", "right"]
    steps: Literal[1, 2, 3]


def test_the_sdks_parse_gives_pydantic_arguments(engine_client, engine_model):
    got = engine_client.chat.completions.parse(
        model=engine_model, messages=user("Which way?"), max_tokens=40, temperature=0,
        tools=[openai.pydantic_function_tool(Pick)], tool_choice={"type": "function", "function": {"name": "Pick"}})
    (call,) = got.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Pick)


def test_a_tool_schema_that_does_not_compile_is_a_400(engine_client, engine_model):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        engine_client.chat.completions.create(model=engine_model, messages=user("x"), tools=[bad],
                                              tool_choice="required")
    assert e.value.body["param"] == "tools"


HERMES_TEMPLATE = (  # a template that renders tools and calls as Qwen2.5's does (written for this test)
    "{%- if tools %}<|im_start|>system\nTools:\n<tools>\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n"
    "</tools>\nCall them as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


LLAMA3_TEMPLATE = (  # a template that renders tools and calls as Llama 3.1's does (written for this test)
    "{%- if tools %}<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please "
    "respond with a JSON for a function call with its proper arguments that best answers the given prompt."
    "\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary of argument name and "
    "its value}.Do not use variables.\n\n{%- for t in tools %}{{ t | tojson }}\n\n{%- endfor %}<|eot_id|>"
    "{%- endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<|start_header_id|>ipython"
    "<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- elif m.tool_calls %}<|start_header_id|>assistant"
    "<|end_header_id|>\n\n{%- for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", "
    "\"parameters\": {{ c.function.arguments | tojson }}}{%- endfor %}<|eot_id|>{%- else %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}")
CONVO = [*user("Weather?"), {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "content": "cold"}]


def test_a_template_that_reads_hermes_calls_gets_the_tools_itself(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    assert tools.dialect(partial(render_chat, tok)) == tools.WRITTEN  # SmolLM2's renders no tools
    tok.chat_template = HERMES_TEMPLATE
    render = partial(render_chat, tok)
    assert tools.dialect(render) == tools.HERMES
    t = tools.check([tools.Tool(type="function", function=tools.Function(name="get_weather"))], None, None)
    convo = CONVO
    messages, draw = tools.form(render, tools.HERMES, convo, t)
    text = draw(messages)
    assert messages == convo and text.startswith("<|im_start|>system\nTools:\n<tools>{")
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text and "# Tools" not in text
    assert "<tool_response>\ncold\n</tool_response>" in text


def test_a_llama3_template_gets_the_tools_itself_and_its_calls_are_read_bare(smollm2, fake, echo):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    tok.chat_template = LLAMA3_TEMPLATE
    render = partial(render_chat, tok)
    assert tools.dialect(render) == tools.LLAMA3
    t = tools.check([tools.Tool(type="function", function=tools.Function(name="get_weather"))], None, None)
    messages, draw = tools.form(render, tools.LLAMA3, CONVO, t)
    text = draw(messages)
    assert messages == CONVO and '"parameters": dictionary of argument name' in text and "# Tools" not in text
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}' in text and "ipython" in text
    # Through the proxy, its answers are read as Llama 3 writes calls (the fake backend echoes).
    px = echo.server.proxy
    px._dialect = tools.LLAMA3
    try:
        ask = '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "F"}}'
        kw = dict(model="fake-tiny", messages=user(ask), tools=[WEATHER, TIME])
        ch = fake.chat.completions.create(**kw).choices[0]
        assert ch.finish_reason == "tool_calls" and not ch.message.content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == [
            ("get_weather", {"city": "Rome", "unit": "F"})]
        content, calls, finish = gathered(fake.chat.completions.create(**kw, stream=True))
        assert (content, finish) == ("", "tool_calls") and [n for _, n, _ in calls] == ["get_weather"]
        plain = fake.chat.completions.create(model="fake-tiny", messages=user(ASK), tools=[WEATHER])
        assert plain.choices[0].message.content == ASK  # a Hermes call is text to a Llama 3 template
    finally:
        px._dialect = None


def test_a_tool_call_parser_reads_its_format_from_any_template_that_renders_tools(smollm2):
    """vLLM's --tool-call-parser: calls read in the named format whatever the template asks
    for; a template that renders no tools gets them written in Hermes' format, so only the
    Hermes parser goes with it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    plain = partial(render_chat, tok)
    assert tools.dialect(plain, "hermes") == tools.WRITTEN
    with pytest.raises(ValueError, match="--tool-call-parser llama3_json: the chat template renders no tools"):
        tools.dialect(plain, "llama3_json")
    tok.chat_template = HERMES_TEMPLATE
    assert tools.dialect(partial(render_chat, tok), "llama3_json") == tools.LLAMA3
    assert tools.dialect(partial(render_chat, tok), "hermes") == tools.HERMES
    tok.chat_template = LLAMA3_TEMPLATE
    assert tools.dialect(partial(render_chat, tok), "hermes") == tools.HERMES


@pytest.mark.slow
def test_smollm2_calls_the_tool_a_question_needs(smollm2):
    """The real model, asked about the weather, required to make one call: it picks the
    weather tool and the city the question names (greedy). (Allowed several, it repeats
    the call.)"""
    from tokendance.backend.service import EngineBackend

    t = Threaded(EngineBackend.load(str(smollm2), dtype="float32", mode="full"))
    try:
        c = t.client()
        free = {**WEATHER, "function": {**WEATHER["function"], "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        for city in ("Paris", "Tokyo"):
            got = c.chat.completions.create(model=t.backend.info.name, tools=[free, TIME], tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=60,
                                            messages=user(f"What is the weather in {city}?"))
            calls = got.choices[0].message.tool_calls
            assert [(x.function.name, json.loads(x.function.arguments)) for x in calls] == [
                ("get_weather", {"city": city})], calls
    finally:
        t.close()
