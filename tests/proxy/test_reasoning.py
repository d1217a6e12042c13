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


def test_include_reasoning_false_leaves_the_reasoning_out(client):
    """vLLM's include_reasoning: false: the content alone, whole and streamed, and neither
    the logprobs nor the output token ids that would spell the reasoning out."""
    kw = dict(model="fake-tiny", messages=user(ANSWER), logprobs=True,
              extra_body={"include_reasoning": False, "return_token_ids": True})
    ch = client.chat.completions.create(**kw).choices[0]
    assert ch.message.content == " Two and two make four, as everyone agreed."
    assert "reasoning" not in (ch.message.model_extra or {}) and ch.logprobs is None
    assert "token_ids" not in ch.model_extra
    shown = client.chat.completions.create(**{**kw, "extra_body": {"return_token_ids": True}}).choices[0]
    assert shown.message.model_extra["reasoning"] and shown.logprobs.content and shown.model_extra["token_ids"]
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == ch.message.content
    assert not any((c.delta.model_extra or {}).get("reasoning") or c.logprobs or (c.model_extra or {}).get("token_ids")
                   for c in chunks)


@pytest.fixture(scope="module")
def r1(tiny_llama):
    """The real engine on the tiny model, its answers read as DeepSeek-R1's."""
    from tokendance.backend.service import EngineBackend

    t = Threaded(EngineBackend.load(str(tiny_llama), dtype="float32", mode="full"), reasoning="deepseek_r1")
    yield t
    t.close()


@pytest.mark.parametrize("n", [0, 4])
def test_a_thinking_budget_forces_the_end_of_the_thinking(r1, tok, n):
    """vLLM's thinking_token_budget: a prompt that opens a think block gets n tokens of it,
    then `</think>` as the tokenizer writes it, then the rest; -1 is no budget."""
    start, end = (tok.encode(x, add_special_tokens=False) for x in ("<think>", "</think>"))
    prompt = tok.encode("Two and two?", add_special_tokens=False) + start
    kw = dict(model=r1.backend.info.name, prompt=prompt, max_tokens=n + len(end) + 3, temperature=0)
    ids = r1.client().completions.create(**kw, extra_body={"thinking_token_budget": n, "return_token_ids": True,
                                                           "ignore_eos": True}).choices[0].model_extra["token_ids"]
    assert ids[n:n + len(end)] == end and len(ids) == n + len(end) + 3
    free = r1.client().completions.create(**kw, extra_body={"thinking_token_budget": -1, "return_token_ids": True,
                                                            "ignore_eos": True}).choices[0].model_extra["token_ids"]
    assert free[n:n + len(end)] != end


def test_a_thinking_budget_needs_a_parser_and_a_count(r1, engine_client, engine_model):
    kw = dict(messages=user("Hi."), max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        engine_client.chat.completions.create(model=engine_model, **kw, extra_body={"thinking_token_budget": 5})
    assert e.value.body["param"] == "thinking_token_budget" and "reasoning parser" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        r1.client().chat.completions.create(model=r1.backend.info.name, **kw, extra_body={"thinking_token_budget": -2})
    assert e.value.body["param"] == "thinking_token_budget" and "at least 0" in e.value.body["message"]


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
