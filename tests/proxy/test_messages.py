"""Anthropic's Messages API through Anthropic's SDK, on the real engine over a tiny random
model: the answer is the chat's the request converts to, whole and streamed, as content
blocks; stop reasons, tool use and results, token counts, reused KV as cache reads,
`x-api-key`, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import msgspec
import pytest

from tokendance.examples.echo import EchoBackend
from tokendance.proxy.messages import Asked, MessagesRequest, chat

from .conftest import Threaded

WEATHER = {"name": "get_weather", "description": "The weather of a city", "input_schema": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["C", "F"]}}}}
HI = [{"role": "user", "content": "Tell me a story."}]
GREEDY = {"temperature": 0}  # the SDK's create() no longer takes it; the API does


@pytest.fixture(scope="module")
def claude(engine_live) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=engine_live.url, api_key="sk-test", max_retries=0)


def test_a_message_is_the_chats_answer_as_a_text_block(claude, engine_client, engine_model):
    got = claude.messages.create(model=engine_model, max_tokens=8, system="Be brief.", messages=HI, extra_body=GREEDY)
    same = engine_client.chat.completions.create(model=engine_model, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, *HI])
    assert got.id.startswith("msg_") and got.type == "message" and got.role == "assistant"
    assert got.model == engine_model and [b.type for b in got.content] == ["text"]
    assert got.content[0].text == same.choices[0].message.content
    assert (got.stop_reason, got.stop_sequence) == ("max_tokens", None)
    u = got.usage
    assert u.input_tokens + u.cache_read_input_tokens == same.usage.prompt_tokens and u.output_tokens == 8
    assert u.model_extra["tokendance"]["kv_dense_bytes"] > 0


def test_a_stream_sends_anthropics_events(claude, engine_model):
    kw = dict(model=engine_model, max_tokens=8, messages=HI, extra_body=GREEDY)
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8
    assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_stop" in events
    assert events.index("content_block_start") < events.index("text") < events.index("message_delta")


def test_a_stop_sequence_is_named(claude, engine_model):
    kw = dict(model=engine_model, max_tokens=8, messages=HI, extra_body=GREEDY)
    text = claude.messages.create(**kw).content[0].text
    word = text[len(text) // 2:][:3]
    assert len(word) == 3
    got = claude.messages.create(**kw, stop_sequences=[word])
    assert (got.stop_reason, got.stop_sequence) == ("stop_sequence", word)
    assert got.content[0].text == text[:text.index(word)]


def test_a_named_tool_is_used_and_its_result_goes_on(claude, engine_model):
    kw = dict(model=engine_model, max_tokens=60, extra_body=GREEDY, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"}], tool_choice={"type": "tool", "name": "get_weather"})
    got = claude.messages.create(**kw)
    (use,) = [b for b in got.content if b.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city", "unit"} and got.stop_reason == "tool_use"
    with claude.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(use.name, use.input)]
    after = [*kw["messages"], {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm",
                                                                   "signature": ""}, use.model_dump()]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"},
                                          {"type": "text", "text": "Thanks!"}]}]
    reply = claude.messages.create(model=engine_model, max_tokens=4, tools=[WEATHER], messages=after)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == claude.messages.count_tokens(
        model=engine_model, tools=[WEATHER], messages=after).input_tokens


def test_count_tokens_is_the_prompts_length(claude, engine_live, engine_model):
    n = claude.messages.count_tokens(model=engine_model, system="Be brief.", messages=HI).input_tokens
    tok = httpx.post(engine_live.url + "/tokenize", json={"messages": [{"role": "system", "content": "Be brief."},
                                                                       *HI]}).json()
    assert n == tok["count"] > 0


def test_reused_kv_counts_as_cache_reads(claude, engine_model):
    long = [{"role": "user", "content": "Remember this list: " + ", ".join(f"item {i}" for i in range(80))}]
    first = claude.messages.create(model=engine_model, max_tokens=2, messages=long, extra_body={
        "tokendance": {"mode": "prefix"}})
    again = claude.messages.create(model=engine_model, max_tokens=2, messages=long, extra_body={
        "tokendance": {"mode": "prefix"}})
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total


@pytest.mark.parametrize("body,where", [
    ({"messages": HI}, "max_tokens"),
    ({"max_tokens": 0, "messages": HI}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0"),
    ({"max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"max_tokens": 4, "messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools.0"),
    ({"max_tokens": 4, "messages": HI, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"max_tokens": 4, "messages": HI, "thinking": {"type": "maybe"}}, "thinking.type"),
    ({"max_tokens": 4, "messages": HI, "output_config": {"format": {"type": "json_schema"}}},
     "output_config.format"),
], ids=["no-max-tokens", "zero-max-tokens", "no-messages", "image", "role", "server-tool", "unnamed-tool",
        "thinking", "format"])
def test_what_cannot_be_answered_is_a_400_in_anthropics_shape(engine_live, engine_model, body, where):
    r = httpx.post(engine_live.url + "/v1/messages", json={"model": engine_model, **body})
    assert r.status_code == 400, r.text
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert where in got["error"]["message"]


def test_another_model_is_anthropics_not_found(claude):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-nope", max_tokens=4, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_x_api_key_is_the_key():
    t = Threaded(EchoBackend(), api_keys=frozenset({"sk-a"}))
    try:
        ok = anthropic.Anthropic(base_url=t.url, api_key="sk-a", max_retries=0)
        got = ok.messages.create(model=t.backend.info.name, max_tokens=16, messages=HI)
        assert got.content[0].text and got.stop_reason in ("end_turn", "max_tokens")
        bad = anthropic.Anthropic(base_url=t.url, api_key="sk-b", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model=t.backend.info.name, max_tokens=4, messages=HI)
        assert e.value.body["error"]["type"] == "authentication_error"
    finally:
        t.close()


def test_a_request_becomes_the_chat_it_asks_for():
    body = dict(model="m", max_tokens=9, system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                messages=[{"role": "user", "content": "Weather?"},
                                     {"role": "assistant", "content": [
                                         {"type": "text", "text": "Let me look."},
                                         {"type": "tool_use", "id": "t1", "name": "get_weather",
                                          "input": {"city": "Oslo"}}]},
                                     {"role": "user", "content": [
                                         {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                          "content": [{"type": "text", "text": "down"}]},
                                         {"type": "text", "text": "Try again."}]},
                                     {"role": "system", "content": "Answer in JSON."}],
                tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                thinking={"type": "disabled"}, stop_sequences=["END"], top_k=5, metadata={"user_id": "u1"},
                output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}})
    c = chat(msgspec.convert(body, MessagesRequest))
    assert [(m.role, m.content) for m in c.messages] == [
        ("system", "Be brief."), ("user", "Weather?"), ("assistant", "Let me look."), ("tool", "Error: down"),
        ("user", "Try again."), ("system", "Answer in JSON.")]
    assert json.loads(c.messages[2].tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert c.messages[3].tool_call_id == "t1" and c.tool_choice == "required" and c.parallel_tool_calls is False
    assert c.tools[0].function.parameters == WEATHER["input_schema"]
    assert c.chat_template_kwargs is None and c.reasoning_effort == "none"  # thinking disabled
    assert (c.stop, c.top_k, c.user) == (["END"], 5, "u1")
    assert c.response_format.json_schema.schema == {"type": "object"} and c.max_tokens == 9
    counted = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "x"}]}, Asked)
    assert chat(counted).max_tokens is None  # count_tokens' part of a request: no length
