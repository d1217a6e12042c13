"""`serve --reasoning-parser`: a chat answer's thinking in its message's `reasoning`, the
rest in `content`, whole and streamed; tool calls read from the content; the session
remembers the content, not the thinking; a structured output holds after the thinking
(the fake backend echoes what it is asked to)."""

from __future__ import annotations

import hashlib
import json

import openai
import pytest

from tokendance.backend.api import Structure
from tokendance.proxy.reasoning import Thinking, held_after

from .conftest import FakeBackend, Threaded, fake

CASES = [  # parser, answer, reasoning, content
    ("qwen3", "<think>\nLet me see.\n</think>\n\nIt is four.", "\nLet me see.\n", "\n\nIt is four."),
    ("qwen3", "\n <think>a</think>b", "a", "b"),
    ("qwen3", "It is four.", "", "It is four."),  # thinking switched off
    ("qwen3", "<thin", "", "<thin"),
    ("qwen3", "<think>cut off while thin", "cut off while thin", ""),
    ("qwen3", "<think>x</think", "x</think", ""),
    ("deepseek_r1", "Let me see.</think>Four.", "Let me see.", "Four."),
    ("deepseek_r1", "<think>Let me see.</think>Four.", "Let me see.", "Four."),
    ("deepseek_r1", "Still thinking", "Still thinking", ""),
    ("deepseek_r1", "", "", ""),
]


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_any_split_of_an_answer_reads_alike(parser, text, reasoning, content):
    assert Thinking(parser).whole(text) == (reasoning, content)
    for cut in range(len(text) + 1):
        for cut2 in range(cut, len(text) + 1):
            th = Thinking(parser)
            parts = [th.feed(text[:cut]), th.feed(text[cut:cut2]), th.feed(text[cut2:]), th.end()]
            assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning, content)


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        Thinking("o1")


@pytest.fixture(scope="module")
def thinking():
    t = Threaded(FakeBackend(length=40), reasoning="qwen3")
    yield t
    t.close()


@pytest.fixture(scope="module")
def client(thinking) -> openai.OpenAI:
    return thinking.client()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


ANSWER = "<think> The others said four; I agree. </think> Two and two make four, as everyone agreed."
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_a_chat_answer_gives_its_reasoning_apart_whole_and_streamed(client):
    kw = dict(model="fake-tiny", messages=user(ANSWER))
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.model_extra["reasoning"] == " The others said four; I agree. "
    assert msg.content == " Two and two make four, as everyone agreed."
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == msg.model_extra["reasoning"]
    assert "".join(d.content or "" for d in deltas) == msg.content
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not (d.model_extra or {}).get("reasoning") for d in deltas[first_content:])


def test_an_answer_without_thinking_is_all_content(client):
    msg = client.chat.completions.create(model="fake-tiny", messages=user("Four, plainly.")).choices[0].message
    assert msg.content == "Four, plainly." and "reasoning" not in (msg.model_extra or {})


def test_tool_calls_are_read_from_the_content(client):
    kw = dict(model="fake-tiny", messages=user(f"<think> Oslo's weather is needed. </think> {CALL}"),
              tools=[WEATHER])
    ch = client.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.model_extra["reasoning"] == " Oslo's weather is needed. "
    assert json.loads(ch.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    streamed = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert streamed[-1].finish_reason == "tool_calls"
    assert any(d.delta.tool_calls for d in streamed)


def test_completions_are_left_as_they_are(client):
    text = client.completions.create(model="fake-tiny", prompt=ANSWER).choices[0].text
    assert text.startswith("<think>")


def test_the_session_remembers_the_answer_not_the_thinking(thinking, client):
    tag = {"tokendance": {"session": "think", "agent": "a", "round": 1}}
    got = client.chat.completions.create(model="fake-tiny", messages=user(ANSWER), extra_body=tag)
    answer = got.choices[0].message.content.strip()
    known = thinking.server.proxy.sessions.known("think", 2, hashlib.sha256(b"sk-test").hexdigest()[:16])
    assert known.get(answer) is not None
    assert known.get("The others said four; I agree.") is None
    # The next round quotes the answer: the proxy finds it and shares it.
    tag2 = {"tokendance": {"session": "think", "agent": "b", "round": 2}}
    later = client.chat.completions.create(model="fake-tiny", messages=user(f"A said: {answer} Agree?"),
                                           extra_body=tag2)
    assert later.usage.model_extra["tokendance"]["shared_tokens"] > 0


@pytest.mark.parametrize("prompt,after", [
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "</think>"),  # Qwen3 thinks in its answer
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", ""),  # enable_thinking false: the prompt closed it
    ("<｜User｜>hi<｜Assistant｜><think>\n", "</think>"),  # R1's template opens it
    ("<think>old</think> then <think>\n", "</think>"),
])
def test_a_structured_output_holds_from_where_the_thinking_ends(prompt, after):
    js = Structure("json_object", param="response_format")
    assert held_after(js, prompt).after == after
    tag = Structure("structural_tag", "{}")
    assert held_after(tag, prompt) is tag  # its free text is free anyway


class Thinker(FakeBackend):
    """Answers with a think block whatever it is asked (the echo would put one in the prompt)."""

    def reply(self, p):
        return fake.words('<think> one key </think> {"a": 1}')


@pytest.fixture(scope="module")
def thinker():
    t = Threaded(Thinker(), reasoning="qwen3")
    yield t
    t.close()


def test_a_structured_answer_thinks_first(thinker):
    """The grammar holds from </think> on (the engine's part: tests/backend/test_grammar.py),
    so the thinking is read out as any answer's is."""
    client = thinker.client()
    got = client.chat.completions.create(model="fake-tiny", messages=user("a JSON object, please"),
                                         response_format={"type": "json_object"})
    msg = got.choices[0].message
    assert (msg.model_extra["reasoning"], msg.content) == (" one key ", ' {"a": 1}')
    st = thinker.backend.groups[-1][0].sampling.structure
    assert (st.kind, st.after) == ("json_object", "</think>")
    r = client.responses.create(model="fake-tiny", input="a JSON object, please",
                                text={"format": {"type": "json_object"}})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    # Thinking switched off, the template closes the block in the prompt: held from the start.
    client.chat.completions.create(model="fake-tiny", messages=user("<think></think> no thinking"),
                                   response_format={"type": "json_object"})
    assert thinker.backend.groups[-1][0].sampling.structure.after == ""


def test_anthropics_messages_give_the_thinking_as_a_thinking_block(thinking):
    import anthropic

    claude = anthropic.Anthropic(base_url=thinking.url, api_key="sk-test", max_retries=0)
    kw = dict(model="fake-tiny", max_tokens=40, messages=user(f"<think> Oslo's weather is needed. </think> {CALL}"),
              tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}])
    got = claude.messages.create(**kw)
    assert [b.type for b in got.content] == ["thinking", "tool_use"] and got.stop_reason == "tool_use"
    assert got.content[0].thinking == " Oslo's weather is needed. " and got.content[1].input == {"city": "Oslo"}
    with claude.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [b.model_dump(exclude={"id"})
                                                                         for b in got.content]  # ids are fresh
    plain = claude.messages.create(model="fake-tiny", max_tokens=40, messages=user(ANSWER))
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in plain.content] == [
        ("thinking", " The others said four; I agree. "), ("text", " Two and two make four, as everyone agreed.")]
