"""Structural tags: what clients send (xgrammar's form, a format alone, vLLM's older
structures + triggers) becomes one xgrammar structural tag; `tool_choice` auto with a
strict tool holds each call it begins to a given function and a strict one's parameters."""

from __future__ import annotations

import json

import pytest

from tokendance.backend.grammar import Grammars
from tokendance.proxy import tools as t
from tokendance.proxy.calls import Hermes, Llama3
from tokendance.proxy.listed import Listed
from tokendance.proxy.errors import ApiError
from tokendance.proxy.structured import ResponseFormat, StructuredOutputs, structure

TWO = {"type": "object", "additionalProperties": False, "required": ["n"],
       "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 99}}}


@pytest.fixture(scope="module")
def grammars(tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    return Grammars(tok, len(tok))


def accepts(grammars, s, text: str, whole: bool = False) -> bool:
    m = grammars.matcher(s)
    return m.accept_string(text) and (not whole or m.is_terminated() or m.accept_token(2))


LEGACY = {"structures": [{"begin": "<n>", "schema": TWO, "end": "</n>"}], "triggers": ["<n>"]}
NEW = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<n>"], "tags": [
    {"type": "tag", "begin": "<n>", "content": {"type": "json_schema", "json_schema": TWO}, "end": "</n>"}]}}


@pytest.mark.parametrize("given", [
    ResponseFormat(type="structural_tag", structures=LEGACY["structures"], triggers=LEGACY["triggers"]),
    ResponseFormat(type="structural_tag", format=NEW["format"]),
    StructuredOutputs(structural_tag=json.dumps(LEGACY)),
    StructuredOutputs(structural_tag=NEW),
    StructuredOutputs(structural_tag=NEW["format"]),
], ids=["response_format legacy", "response_format", "vllm legacy text", "vllm", "a format alone"])
def test_every_form_is_the_same_tag(grammars, given):
    s = structure(given, None) if isinstance(given, ResponseFormat) else structure(None, given)
    assert s.kind == "structural_tag" and json.loads(s.spec)["format"]["triggers"] == ["<n>"]
    assert accepts(grammars, s, 'Say <n>{"n": 42}</n> and go on, <n>{"n": 10}</n>.')
    assert not accepts(grammars, s, 'Say <n>{"n": 7}')  # the schema holds inside the tag
    assert not accepts(grammars, s, "Say <n>hello")


@pytest.mark.parametrize("given,message", [
    (StructuredOutputs(structural_tag="{not json"), "must be JSON"),
    (StructuredOutputs(structural_tag=[1]), "must be a JSON object"),
    (StructuredOutputs(structural_tag={"type": "structural_tag", "format": 5}), "needs a format"),
    (StructuredOutputs(structural_tag={"structures": [], "triggers": ["<n>"]}), "structures must be"),
    (StructuredOutputs(structural_tag={"structures": LEGACY["structures"], "triggers": [""]}), "triggers must"),
    (ResponseFormat(type="structural_tag"), "structures must be"),
])
def test_malformed_tags_are_400s(given, message):
    with pytest.raises(ApiError) as e:
        structure(given, None) if isinstance(given, ResponseFormat) else structure(None, given)
    assert e.value.status == 400 and message in str(e.value)


WEATHER = t.Tool(type="function", function=t.Function(name="get_weather", strict=True, parameters={
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"enum": ["Paris", "Oslo"]}}}))
NOTE = t.Tool(type="function", function=t.Function(name="note", parameters={"type": "object"}))


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def test_auto_with_a_strict_tool_holds_its_calls(grammars):
    tools = t.check([WEATHER, NOTE], "auto", None)
    s = tools.structure()
    assert s.kind == "structural_tag" and s.param == "tools"
    assert accepts(grammars, s, "No call needed.")
    assert accepts(grammars, s, "Let me look. " + call("get_weather", '{"city": "Oslo"}') + "\n"
                   + call("note", '{"anything": [1, 2]}'))
    assert not accepts(grammars, s, call("get_weather", '{"city": "Rome"}'))  # strict: its enum
    assert not accepts(grammars, s, call("get_weather", '{"town": "Oslo"}'))
    assert not accepts(grammars, s, call("weather", "{}"))  # only given functions
    assert not accepts(grammars, s, call("note", "[1]"))  # arguments are an object
    # The Hermes reader reads what the tag lets through.
    got = Hermes().whole("Here: " + call("get_weather", '{"city": "Paris"}'))
    assert got.content.strip() == "Here:"
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", {"city": "Paris"})]


def test_one_call_at_most_without_parallel_calls_and_none_without_strict(grammars):
    one = t.check([WEATHER, NOTE], "auto", False).structure()
    assert accepts(grammars, one, "Sure. " + call("get_weather", '{"city": "Paris"}'), whole=True)
    assert not accepts(grammars, one, call("get_weather", '{"city": "Paris"}') + " and more")
    assert t.check([NOTE], "auto", None).structure() is None  # nothing strict: the output is free
    assert t.check([WEATHER], "none", None).structure() is None


def test_a_llama3_template_holds_its_bare_calls(grammars):
    tools = t.check([WEATHER, NOTE], "auto", None)
    tools.dialect = t.LLAMA3
    s = tools.structure()
    bare = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert accepts(grammars, s, bare) and accepts(grammars, s, "It is cold.")
    assert not accepts(grammars, s, '{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert not accepts(grammars, s, call("get_weather", '{"city": "Oslo"}'))  # '{"name": ' begins a bare call
    assert [(c.name, json.loads(c.arguments)) for c in Llama3().whole(bare).calls] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("dialect", [t.GRANITE, t.PHI4])
def test_a_marked_list_template_holds_each_call_to_a_list_after_its_marker(grammars, dialect):
    tools = t.check([WEATHER, NOTE], "auto", None)
    tools.dialect = dialect
    s, mark = tools.structure(), t.MARKERS[dialect][0]
    held = f'{mark}[{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}]'
    assert accepts(grammars, s, held) and accepts(grammars, s, "It is cold.")
    assert not accepts(grammars, s, f'{mark}[{{"name": "get_weather", "arguments": {{"city": "Rome"}}}}]')
    got = Listed(t.MARKERS[dialect]).whole(held + held.replace("get_weather", "note"))
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", {"city": "Oslo"}),
                                                                       ("note", {"city": "Oslo"})]
